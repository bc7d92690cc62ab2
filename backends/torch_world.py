"""Starting a torch.distributed world: is gloo there, which device, and the rendezvous.

    connect = prepare(world_size=4, timeout=60.0)    # in the launcher, before it forks
    comm = connect(rank)                             # in each forked rank: a TorchComm

Rendezvous is a TCPStore on loopback served by rank 0 on a socket the launcher bound
before forking, so no two worlds race for a port. ``--device cuda`` (``DPLAB_DEVICE=cuda``)
picks NCCL, one GPU per rank; with fewer GPUs than ranks it is a ``ConfigError``.
"""

from __future__ import annotations

import importlib
import os
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

from reference.errors import ConfigError

if TYPE_CHECKING:
    from backends.torchdist import TorchComm

__all__ = ["available", "prepare", "wants_cuda", "startup_timeout", "torch_modules"]


@cache
def torch_modules() -> tuple[Any, Any]:
    """(torch, torch.distributed), imported on first use: importing dplab stays cheap."""
    return importlib.import_module("torch"), importlib.import_module("torch.distributed")


def available() -> str | None:
    """None when torch.distributed with gloo can be used, else why not and what to install."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed: pip install 'dplab[torch]'"
    gloo = dist.is_available() and dist.is_gloo_available()
    return None if gloo else "this torch lacks torch.distributed/gloo: pip install 'dplab[torch]' (official)"


def prepare(world_size: int, timeout: float, device: str | None = None) -> Callable[[int], TorchComm]:
    """In the launcher, before it forks: bind the socket rank 0's TCPStore serves on (127.0.0.1, a
    fresh port). Binding a port picked earlier in rank 0 lost races on a busy machine."""
    wants_cuda(device, world_size)  # fail here, not in every rank
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def connect(rank: int) -> TorchComm:
        from backends.torchdist import TorchComm

        torch, dist = torch_modules()
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; 1 core/rank
        fd = listener.detach() if rank == 0 else listener.close()  # rank 0 serves on it
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, startup_timeout(timeout),
                              master_listen_fd=fd)
        return TorchComm(rank, world_size, timeout, device=device, local_rank=rank, store=store)

    weakref.finalize(connect, listener.close)  # the launcher's copy, once every rank is forked
    return connect


def startup_timeout(timeout: float) -> timedelta:
    """Start-up may take seconds (imports, NCCL); ``timeout`` is for peers' waits afterwards."""
    return timedelta(seconds=max(timeout, 60.0))


def wants_cuda(device: str | None, local_ranks: int) -> bool:
    """True for NCCL on GPUs, False for gloo on CPU; a ConfigError when GPUs are short."""
    kind = (device or os.environ.get("DPLAB_DEVICE") or "cpu").split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {kind!r}")
    if kind == "cuda" and (have := torch_modules()[0].cuda.device_count()) < local_ranks:  # NVML: fork-safe
        raise ConfigError(f"{local_ranks} ranks need {local_ranks} GPUs, this machine has {have}: "
                          "use --device cpu (gloo), i.e. DPLAB_DEVICE=cpu")
    return kind == "cuda"
