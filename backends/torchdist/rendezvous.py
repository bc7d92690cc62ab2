"""Where forked torch ranks meet: a TCPStore on loopback, bound before the fork.

    connect, _ = prepare(ctx, session, world_size=4, timeout=60.0)   # the launcher, before it forks
    comm = connect(rank)                             # in each forked rank: a TorchComm

Rank 0 serves the store on a socket the launcher bound before forking, so no two worlds race
for a port. gloo's (and NCCL's) own sockets go on loopback too (``GLOO_SOCKET_IFNAME=lo``,
``NCCL_SOCKET_IFNAME=lo`` in the forked ranks, unless you set them): left alone, gloo binds to
whatever the host name resolves to, often a public interface. Under ``torchrun`` none of this
runs: the launcher's own rendezvous and your environment are used as they are.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable

from dplab.backends.torchdist.comm import TorchComm
from dplab.backends.torchdist.setup import startup_timeout, torch_modules, wants_cuda

__all__ = ["prepare", "loopback_interface"]


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None if neither."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def prepare(ctx: object, session: str, world_size: int, timeout: float,
            device: str | None = None) -> tuple[Callable[[int], TorchComm], None]:
    """In the launcher, before it forks: bind the socket rank 0's TCPStore serves on (127.0.0.1, a
    fresh port). Binding a port picked earlier in rank 0 lost races on a busy machine. Returns
    (connect(rank), nothing to keep), as every backend's ``prepare``
    (``dplab.backends.registry``)."""
    wants_cuda(device, world_size)  # fail here, not in every rank
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def connect(rank: int) -> TorchComm:
        torch, dist = torch_modules()
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; 1 core/rank
        if (lo := loopback_interface()) is not None:  # this forked rank's environment only
            for engine in ("GLOO", "NCCL"):
                os.environ.setdefault(f"{engine}_SOCKET_IFNAME", lo)  # a user's choice stays
        fd = listener.detach() if rank == 0 else listener.close()  # rank 0 serves on it
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, startup_timeout(timeout),
                              master_listen_fd=fd)
        return TorchComm(rank, world_size, timeout, device=device, local_rank=rank, store=store)

    weakref.finalize(connect, listener.close)  # the launcher's copy, once every rank is forked
    return connect, None
