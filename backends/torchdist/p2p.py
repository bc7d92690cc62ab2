"""torch.distributed point to point: messages, their headers, and clear errors.

A message (``isend``/``irecv``) is a header (length, dtype, tag) plus the data. gloo kills
the process when a message is longer than the receive posted for it and half-fills a shorter
one silently; so the data travels under a gloo tag made from its (length, dtype), where a
wrong-shape message never matches, and the header, waited for first, reports the mismatch at
once as ``BufferMismatch``. Our tags are checked, not used to pick messages (as in the local
backend). NCCL has no tags: there the header goes first and the data follows in order.

Every wait passes ``timeout`` to ``Work.wait``: "Timed out" becomes ``CommTimeout`` naming
the peer, a lost connection (a dead peer) a ``CommError``; after either, restart the world
(``launch`` and ``World`` do), as messages may still be in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from dplab.backends.torchdist.setup import startup_timeout, wants_cuda
from dplab.backends.torchdist.setup import torch_modules as _torch
from dplab.reference.communicator import (
    ANY_SOURCE,
    BufferMismatch,
    CommError,
    CommTimeout,
    Communicator,
    PeerLost,
    Request,
)
from dplab.reference.errors import ConfigError
from dplab.reference.trace import Tracer

__all__ = ["TorchPeer", "HEADER_TAG", "code", "data_tag", "DTYPES"]

# the header's dtype codes
DTYPES = ("uint8", "float32", "float64", "int32", "int64", "float16", "bfloat16")
HEADER_TAG = 1 << 30  # data tags, (length, dtype) folded, stay below it


class TorchPeer(Communicator):
    """One rank of a torch.distributed process group: its point-to-point messages, errors and
    control path. ``TorchComm`` (comm.py) adds the rounds and collectives."""

    backend, moves_tensors, host_tensors = "torch", True, True

    def __init__(self, rank: int | None, world_size: int | None, timeout: float = 60.0,
                 init_method: str = "env://", device: str | None = None,
                 local_rank: int | None = None, store: Any = None, group: Any = None) -> None:
        """Start a process group, or, if torch.distributed is initialised already (the user's
        ``dist.init_process_group``), speak over ``group`` (None: the default group) and leave
        it to its owner: ``close()`` then destroys nothing (``owns_group`` is False).

        Args:
            rank: this process's rank; None to take the initialised group's.
            world_size: ranks in the group; None to take the initialised group's.
            timeout: seconds any blocking wait may take.
            init_method: torch.distributed's rendezvous (``env://``, ``tcp://...``).
            device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); None: ``DPLAB_DEVICE``, else cpu (in
                an initialised group, its backend decides).
            local_rank: the GPU of this rank under NCCL; None: the rank.
            store: a ``TCPStore`` to meet at instead of ``init_method``.
            group: an initialised torch.distributed's group to speak over (None: the default).

        Raises:
            ConfigError: ``group`` without an initialised torch.distributed, a rank or world size
                that disagrees with the initialised group's, this process outside ``group``, an
                unknown device or one the group's backend cannot serve, or fewer GPUs than ranks.
        """
        torch, dist = _torch()
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            if group is not None:
                raise ConfigError("group= is a group of an initialised torch.distributed: call "
                                  "dist.init_process_group(...) first, or pass no group")
            self._start_group(rank, world_size, timeout, init_method, device, local_rank, store)
        else:
            self._adopt(group, device, local_rank)
        self.rank, self.world_size = dist.get_rank(self._group), dist.get_world_size(self._group)
        if (rank, world_size) != (self.rank, self.world_size) and (rank, world_size) != (None,
                                                                                         None):
            raise ConfigError(f"asked for rank {rank} of {world_size}, but the initialised "
                              f"process group says rank {self.rank} of {self.world_size}: pass "
                              "no rank, use TorchComm.from_process_group()")
        self.timeout, self.tracer, self._td = timeout, Tracer(self.rank), timedelta(seconds=timeout)

    def _start_group(self, rank: int | None, world_size: int | None, timeout: float,
                     init_method: str,
                     device: str | None, local_rank: int | None, store: Any) -> None:
        torch, dist = _torch()
        if rank is None or world_size is None:
            raise ConfigError("torch.distributed is not initialised: pass rank and world_size, "
                              "or call dist.init_process_group(...) first")
        self.nccl = wants_cuda(device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        self.device = torch.device("cpu")
        if self.nccl:
            self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            torch.cuda.set_device(self.device)
        # device_id: NCCL connects now, so a later batch may involve only some of the ranks
        dist.init_process_group("nccl" if self.nccl else "gloo", store=store, rank=rank,
                                world_size=world_size, init_method=None if store else init_method,
                                timeout=startup_timeout(timeout),
                                device_id=self.device if self.nccl else None)
        self._group = dist.group.WORLD  # its ranks are the global ranks

    def _adopt(self, group: Any, device: str | None, local_rank: int | None) -> None:
        """The caller's group. Its backend picks the device (NCCL: this process's current GPU);
        a group that also has gloo (``cpu:gloo,cuda:nccl``) moves host
        memory unless device="cuda"."""
        torch, dist = _torch()
        self._group = dist.group.WORLD if group is None else group
        if dist.get_rank(self._group) < 0:
            raise ConfigError("this process is not a member of the group it was given")
        backend = str(dist.get_backend(self._group))
        kind = device or ("cuda" if backend == "nccl" else "cpu")
        self.nccl = wants_cuda(kind, 1) and "nccl" in backend
        if kind.startswith("cuda") and not self.nccl:
            raise ConfigError(f"device {kind!r} needs an NCCL group, this one is {backend!r}")
        if self.nccl and self._group is not dist.group.WORLD:
            raise ConfigError("an NCCL subgroup is not supported yet: use the default group, "
                              "or gloo")
        index = (local_rank if local_rank is not None
                 else torch.cuda.current_device() if self.nccl else 0)
        self.device = torch.device("cuda", index) if self.nccl else torch.device("cpu")

    # dist.isend/irecv check their arguments and translate ranks on every call, which about
    # doubles what posting a message costs (backends/PERFORMANCE.md); the process group's own
    # send/recv, which they end in, skip that.
    def _isend(self, t: Any, dst: int, tag: int) -> Any:
        return self._group.send([t], dst, tag)

    def _irecv(self, t: Any, src: int, tag: int) -> Any:
        return (self._group.recv_anysource([t], tag) if src == ANY_SOURCE
                else self._group.recv([t], src, tag))

    @classmethod
    def from_process_group(cls, group: Any = None, timeout: float = 60.0,
                           device: str | None = None) -> TorchPeer:
        """A communicator over a process group the caller started, as torch scripts do:

            dist.init_process_group("gloo")                  # or under torchrun, env://
            comm = TorchComm.from_process_group()            # group=None: the default group
            model = DDP(Net(), comm)
            ...
            comm.close()                                     # the group stays; destroy it yourself

        Ranks are the group's own (``dist.get_rank(group)``), as in torch's collectives.

        Args:
            group: the process group (None: the default group).
            timeout: seconds any blocking wait may take.
            device: ``"cpu"`` or ``"cuda"``; None: the group's backend decides.

        Returns:
            A communicator over ``group``; its ``close()`` leaves the group to its owner.

        Raises:
            ConfigError: torch.distributed is not initialised, or the group does not fit.
        """
        if not _torch()[1].is_initialized():
            raise ConfigError("torch.distributed is not initialised: call "
                              "dist.init_process_group(...) first, or start ranks with "
                              "dplab's launch()")
        return cls(None, None, timeout, device=device, group=group)

    @classmethod
    def from_launcher(cls, timeout: float) -> TorchPeer:
        """This process as one rank of a torchrun job (env:// rendezvous)."""
        env = os.environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), timeout, "env://",
                   local_rank=int(env.get("LOCAL_RANK", env["RANK"])))

    def _on_device(self, buf: Any) -> tuple[Any, Any]:
        """(the tensor to move, the host tensor to copy a receive back into, or None)."""
        torch, _ = _torch()
        t = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or code(t) < 0:
            raise CommError(f"rank {self.rank}: messages are contiguous arrays or tensors of "
                            f"one of {', '.join(DTYPES)}; got {type(buf).__name__} "
                            f"{getattr(buf, 'dtype', '')}")
        return (t, None) if t.device == self.device else (t.to(self.device), t)  # the NCCL copy

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Request:
        torch, _ = _torch()
        self._check_peer(dst)
        t, _ = self._on_device(buf)
        header = torch.tensor([t.numel(), code(t), tag], dtype=torch.int64, device=self.device)
        with self._explain(dst, "to take its message"):
            works = [self._isend(header, dst, HEADER_TAG), self._isend(t, dst, data_tag(t))]
        return SimpleNamespace(wait=lambda: self._finish(works, [dst, dst], "to take its message"))

    def irecv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0) -> Request:
        """Posts the header (and, from a known source, the data); ``wait()``
        checks, returns the source."""
        torch, _ = _torch()
        self._check_peer(src, any_ok=True)
        if src == ANY_SOURCE and self.nccl:
            raise CommError("NCCL cannot receive from any source: use gloo (DPLAB_DEVICE=cpu)")
        t, host = self._on_device(buf)
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        with self._explain(src, "for its message"):
            works = [self._irecv(header, src, HEADER_TAG)]
            if src != ANY_SOURCE:  # post the data now: its tag matches only a message of this shape
                works.append(self._irecv(t, src, data_tag(t)))

        @cache  # wait() twice returns the same source
        def wait() -> int:
            self._finish(works[:1], [src], "for its message")
            source = src if src != ANY_SOURCE else works[0]._source_rank()
            their_tag = self._check_header(header.cpu().numpy(), t, source)
            with self._explain(source, "for its message"):
                if len(works) == 1:  # from any source: the data can only be posted now
                    works.append(self._irecv(t, source, data_tag(t)))
                works[1].wait(self._td)  # taken even under a wrong tag: the next one still arrives
            if host is not None:
                host.copy_(t)
            if their_tag != tag:
                raise CommError(f"rank {self.rank} expected tag {tag} from rank {source}, got tag "
                                f"{their_tag}: messages between two ranks are matched in order")
            return source

        return SimpleNamespace(wait=wait)  # a Request

    def _check_peer(self, peer: int, any_ok: bool = False) -> None:
        if not (any_ok and peer == ANY_SOURCE) and (not 0 <= peer < self.world_size
                                                    or peer == self.rank):
            raise CommError(f"rank {self.rank}: peer {peer} is not another rank in "
                            f"0..{self.world_size - 1}")

    def _check_header(self, header: np.ndarray, t: Any, src: int) -> int:
        """Raise BufferMismatch unless the message is ``t``'s length and dtype; returns its tag."""
        n, theirs, their_tag = (int(v) for v in header)
        if n != t.numel() or theirs != code(t):
            raise BufferMismatch(f"rank {self.rank} expected {t.numel()} x {DTYPES[code(t)]} "
                                 f"from rank {src} but rank {src} sent {n} x "
                                 f"{DTYPES[theirs]}: every rank must pass a buffer of the same "
                                 "length and dtype to a collective")
        return their_tag

    @contextmanager
    def _explain(self, peer: int | list[int], what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:
            raise self._failure(e, peer, what) from e

    def _failure(self, e: RuntimeError, peer: int | list[int], what: str) -> CommError:
        """gloo and NCCL report timeouts and lost peers as
        RuntimeError: say who and what instead."""
        who = ("any rank" if peer == ANY_SOURCE else f"rank {peer}" if isinstance(peer, int)
               else "ranks " + ", ".join(map(str, peer)))
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():  # gloo; NCCL's watchdog
            return CommTimeout(f"rank {self.rank} waited {self.timeout:.0f}s for {who} {what}: "
                               "is that rank dead or stuck? (set DPLAB_TIMEOUT to wait longer)")
        return PeerLost(f"rank {self.rank} lost {who} while waiting {what}: that rank died "
                        "or failed "
                         f"(see its error). The transport said: {str(e).splitlines()[0]}")

    def _finish(self, works: list, peers: list[int], what: str) -> None:
        """Wait for works, one per peer (gloo), or one for a batch with all of them (NCCL)."""
        for i, work in enumerate(works):
            try:
                work.wait(self._td)
            except RuntimeError as e:
                raise self._failure(e, peers[i] if len(works) == len(peers) else peers, what) from e

    def barrier(self) -> None:
        with self._explain(list(range(self.world_size)), "at a barrier"):
            _torch()[1].barrier(group=self._group, async_op=True).wait(self._td)

    def allgather_object(self, obj: Any) -> list:
        """Everyone's ``obj``, pickled: the launcher's control path, never the data path."""
        out: list = [None] * self.world_size
        _torch()[1].all_gather_object(out, obj, group=self._group)
        return out

    def abort(self) -> None:
        """Leave now, waiting for nobody (NCCL kernels included): peers see the connection close."""
        self.close(getattr(_torch()[1].distributed_c10d, "_abort_process_group", None))

    def close(self, how: Callable[[], None] | None = None) -> None:
        """Destroy the process group this communicator started; one it
        was given stays its owner's."""
        if self.owns_group and _torch()[1].is_initialized():
            (how or _torch()[1].destroy_process_group)()


@cache
def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    return DTYPES.index(name) if name in DTYPES else -1


def code(t: Any) -> int:
    """The header's code for a tensor's (or array's) dtype; -1 if messages cannot carry it."""
    return _dtype_code(t.dtype)


def data_tag(t: Any) -> int:
    """The gloo tag of a message of this shape: only a receive of the same shape can match it."""
    return (t.numel() * len(DTYPES) + code(t)) % HEADER_TAG
