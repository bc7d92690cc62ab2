"""The torch.distributed backend: gloo on CPU, NCCL on GPUs (one GPU per rank).

    dplab train --backend torch --world-size 4                 # ranks forked here, gloo on loopback
    torchrun --nproc-per-node 4 -m backends.cli train --backend torch            # torchrun's ranks
    DPLAB_DEVICE=cuda torchrun --nproc-per-node 4 -m backends.cli train --backend torch    # NCCL

``DPLAB_DEVICE=cuda`` picks NCCL and GPU ``LOCAL_RANK``: N ranks on one machine need N GPUs,
else a ``ConfigError`` says to use --device cpu (gloo). Numpy arrays go through
``torch.from_numpy`` (no copy); NCCL moves only GPU memory, so there a host buffer is copied to
the GPU, and back after a receive. Device tensors go straight through. Nothing is pickled.

Every message is a header (length, dtype, tag) plus the data. gloo kills the process when a
message is longer than the receive posted for it and half-fills a shorter one silently; so the
data travels under a gloo tag made from its (length, dtype), where a wrong-shape message never
matches, and the header, waited for first, reports the mismatch at once as ``BufferMismatch``.
Our tags are checked, not used to pick messages (as in the local backend). NCCL has no tags:
there a round's headers go first. Every wait passes ``timeout`` to ``Work.wait``: "Timed out"
becomes ``CommTimeout`` naming the peer, a lost connection (a dead peer) a ``CommError``; after
either, restart the world (``launch`` and ``World`` do), as messages may still be in flight.
"""

from __future__ import annotations

import importlib
import os
import socket
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from reference.communicator import ANY_SOURCE, BufferMismatch, CommError, CommTimeout, Communicator
from reference.errors import ConfigError
from reference.trace import Tracer

if TYPE_CHECKING:
    from reference.communicator import RecvSpec, Request, SendSpec

__all__ = ["available", "prepare", "TorchComm"]

_DTYPES = ("uint8", "float32", "float64", "int32", "int64", "float16")  # the header's dtype codes
HEADER_TAG = 1 << 30  # data tags, (length, dtype) folded, stay below it


def _torch() -> tuple[Any, Any]:  # imported on first use, so that importing this module stays cheap
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
    _wants_cuda(device, world_size)  # fail here, not in every rank
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def connect(rank: int) -> TorchComm:
        torch, dist = _torch()
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; 1 core/rank
        fd = listener.detach() if rank == 0 else listener.close()  # rank 0 serves on it
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, _startup(timeout),
                              master_listen_fd=fd)
        return TorchComm(rank, world_size, timeout, device=device, local_rank=rank, store=store)

    weakref.finalize(connect, listener.close)  # the launcher's copy, once every rank is forked
    return connect


def _startup(timeout: float) -> timedelta:  # start-up may take seconds; timeout is for peers' waits
    return timedelta(seconds=max(timeout, 60.0))


def _wants_cuda(device: str | None, local_ranks: int) -> bool:
    kind = (device or os.environ.get("DPLAB_DEVICE") or "cpu").split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {kind!r}")
    if kind == "cuda" and (have := _torch()[0].cuda.device_count()) < local_ranks:  # NVML: fork-safe
        raise ConfigError(f"{local_ranks} ranks need {local_ranks} GPUs, this machine has {have}: "
                          "use --device cpu (gloo), i.e. DPLAB_DEVICE=cpu")
    return kind == "cuda"


class TorchComm(Communicator):
    """One rank of a torch.distributed process group, speaking dplab's Communicator."""

    def __init__(self, rank: int, world_size: int, timeout: float = 60.0, init_method: str = "env://",
                 device: str | None = None, local_rank: int | None = None, store: Any = None) -> None:
        torch, dist = _torch()
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.tracer, self._td = Tracer(rank), timedelta(seconds=timeout)
        self.nccl = _wants_cuda(device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        self.device = torch.device("cpu")
        if self.nccl:
            self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            torch.cuda.set_device(self.device)
        # device_id: NCCL connects now, so a later batch may involve only some of the ranks
        dist.init_process_group("nccl" if self.nccl else "gloo", store=store, rank=rank,
                                world_size=world_size, init_method=None if store else init_method,
                                timeout=_startup(timeout), device_id=self.device if self.nccl else None)
        self._scratch: dict[Any, Any] = {}  # (dtype, k) -> where the k-th reduce of a round lands

    @classmethod
    def from_launcher(cls, timeout: float) -> TorchComm:
        """This process as one rank of a torchrun job (env:// rendezvous)."""
        env = os.environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), timeout, "env://",
                   local_rank=int(env.get("LOCAL_RANK", env["RANK"])))

    def _on_device(self, buf: Any) -> tuple[Any, Any]:
        """(the tensor to move, the host tensor to copy a receive back into, or None)."""
        torch, _ = _torch()
        t = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or _code(t) < 0:
            raise CommError(f"rank {self.rank}: messages are contiguous arrays or tensors of one of "
                            f"{', '.join(_DTYPES)}; got {type(buf).__name__} {getattr(buf, 'dtype', '')}")
        return (t, None) if t.device == self.device else (t.to(self.device), t)  # the NCCL copy

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Request:
        torch, dist = _torch()
        self._check_peer(dst)
        t, _ = self._on_device(buf)
        header = torch.tensor([t.numel(), _code(t), tag], dtype=torch.int64, device=self.device)
        with self._explain(dst, "to take its message"):
            works = [dist.isend(header, dst, tag=HEADER_TAG), dist.isend(t, dst, tag=_data_tag(t))]
        return SimpleNamespace(wait=lambda: self._finish(works, [dst, dst], "to take its message"))

    def irecv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0) -> Request:
        """Posts the header (and, from a known source, the data); ``wait()`` checks, returns the source."""
        torch, dist = _torch()
        self._check_peer(src, any_ok=True)
        if src == ANY_SOURCE and self.nccl:
            raise CommError("NCCL cannot receive from any source: use gloo (DPLAB_DEVICE=cpu)")
        t, host = self._on_device(buf)
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        with self._explain(src, "for its message"):
            works = [dist.irecv(header, None if src == ANY_SOURCE else src, tag=HEADER_TAG)]
            if src != ANY_SOURCE:  # post the data now: its tag matches only a message of this shape
                works.append(dist.irecv(t, src, tag=_data_tag(t)))

        @cache  # wait() twice returns the same source
        def wait() -> int:
            self._finish(works[:1], [src], "for its message")
            source = src if src != ANY_SOURCE else works[0]._source_rank()
            their_tag = self._check_header(header.cpu().numpy(), t, source)
            with self._explain(source, "for its message"):
                if len(works) == 1:  # from any source: the data can only be posted now
                    works.append(dist.irecv(t, source, tag=_data_tag(t)))
                works[1].wait(self._td)  # taken even under a wrong tag: the next one still arrives
            if host is not None:
                host.copy_(t)
            if their_tag != tag:
                raise CommError(f"rank {self.rank} expected tag {tag} from rank {source}, got tag "
                                f"{their_tag}: messages between two ranks are matched in order")
            return source

        return SimpleNamespace(wait=wait)  # a Request

    def _check_peer(self, peer: int, any_ok: bool = False) -> None:
        if not (any_ok and peer == ANY_SOURCE) and (not 0 <= peer < self.world_size or peer == self.rank):
            raise CommError(f"rank {self.rank}: peer {peer} is not another rank in 0..{self.world_size - 1}")

    def _check_header(self, header: np.ndarray, t: Any, src: int) -> int:
        """Raise BufferMismatch unless the message is ``t``'s length and dtype; returns its tag."""
        n, code, their_tag = (int(v) for v in header)
        if n != t.numel() or code != _code(t):
            raise BufferMismatch(f"rank {self.rank} expected {t.numel()} x {_DTYPES[_code(t)]} from rank "
                                 f"{src} but rank {src} sent {n} x {_DTYPES[code]}: every rank must pass a "
                                 "buffer of the same length and dtype to a collective")
        return their_tag

    @contextmanager
    def _explain(self, peer: int | list[int], what: str) -> Iterator[None]:
        """gloo and NCCL report timeouts and lost peers as RuntimeError: say who and what instead."""
        try:
            yield
        except RuntimeError as e:
            who = ("any rank" if peer == ANY_SOURCE else f"rank {peer}" if isinstance(peer, int)
                   else "ranks " + ", ".join(map(str, peer)))
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():  # gloo; NCCL's watchdog
                raise CommTimeout(f"rank {self.rank} waited {self.timeout:.0f}s for {who} {what}: is that "
                                  "rank dead or stuck? (set DPLAB_TIMEOUT to wait longer)") from e
            raise CommError(f"rank {self.rank} lost {who} while waiting {what}: that rank died or failed "
                            f"(see its error). The transport said: {str(e).splitlines()[0]}") from e

    def _finish(self, works: list, peers: list[int], what: str) -> None:
        """Wait for a batch: gloo gives one work per message (named by its peer), NCCL one for all."""
        for i, work in enumerate(works):
            with self._explain(peers[i] if len(works) == len(peers) else sorted(set(peers)), what):
                work.wait(self._td)

    # -- rounds and collectives ---------------------------------------------------------------
    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """One round, batched: headers and data of every message; wait, check, then add in order."""
        torch, dist = _torch()
        tr, R, S, t_post = self.tracer, len(recvs), len(sends), self.tracer.now()
        out = [self._on_device(s.buf)[0] for s in sends]
        ins = [self._on_device(r.buf) for r in recvs]
        land = [self._scratch_for(t, k) if r.reduce else t for k, ((t, _), r) in enumerate(zip(ins, recvs))]
        hdr = torch.tensor([[0, 0, 0]] * R + [[t.numel(), _code(t), 0] for t in out], dtype=torch.int64,
                           device=self.device).reshape(R + S, 3)
        peers = [r.peer for r in recvs] + [s.peer for s in sends]
        kinds = [dist.irecv] * R + [dist.isend] * S
        heads = [dist.P2POp(k, hdr[i], p, tag=HEADER_TAG) for i, (k, p) in enumerate(zip(kinds, peers))]
        data = [dist.P2POp(k, t, p, tag=_data_tag(t)) for k, t, p in zip(kinds, land + out, peers)]
        what = f"in round {round} of {algorithm or 'an exchange'}"
        with self._explain(peers, what):  # gloo: one batch, a data message only matches its shape
            works = dist.batch_isend_irecv(heads if self.nccl else heads + data) if peers else []
        self._finish(works if self.nccl else works[:R], peers if self.nccl else peers[:R], what)
        for row, (t, _), peer in zip(hdr[:R].cpu().numpy(), ins, peers):
            self._check_header(row, t, peer)
        if self.nccl and (data := [op for op in data if op.tensor.numel()]):  # empty ones: done
            with self._explain(peers, what):  # no tags on NCCL: data moves once the headers agree
                works = dist.batch_isend_irecv(data)
        self._finish(works if self.nccl else works[R:], peers if self.nccl else peers[R:] + peers, what)
        for t, s in zip(out, sends):
            tr.record("send", t_post, tr.now(), peer=s.peer, bytes=t.nbytes, chunk=s.chunk,
                      round=round, algorithm=algorithm)
        for (t, host), tmp, r in zip(ins, land, recvs):  # every send has left: adding is safe now
            t0 = tr.now()
            if r.reduce:
                t.add_(tmp)
            if host is not None:
                host.copy_(t)
            tr.record("reduce" if r.reduce else "copy", t0, tr.now(), peer=r.peer, bytes=t.nbytes,
                      chunk=r.chunk, round=round, algorithm=algorithm)

    def _scratch_for(self, t: Any, k: int) -> Any:
        """Where a round's k-th reduce lands: scratch that grows to the largest seen, then is reused."""
        have = self._scratch.get((t.dtype, k))
        if have is None or have.numel() < t.numel():
            have = self._scratch[t.dtype, k] = _torch()[0].empty(t.numel(), dtype=t.dtype, device=self.device)
        return have[:t.numel()]

    def native_allreduce(self, buf: Any, op: str = "sum") -> None:
        """gloo's (or NCCL's) own all-reduce, in place: the yardstick for ours. A 4-integer MAX
        all-reduce of (length, dtype, -length, -dtype) goes first: gloo aborts the process on a
        longer buffer and sums a same-size buffer of another dtype into garbage."""
        torch, dist = _torch()
        if op not in ("sum", "mean"):
            raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
        t, host = self._on_device(buf)
        n, code = t.numel(), _code(t)
        shape = torch.tensor([n, code, -n, -code], dtype=torch.int64, device=self.device)
        with self._explain(list(range(self.world_size)), "in all_reduce"):
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, async_op=True).wait(self._td)
            hi_n, hi_code, lo_n, lo_code = (abs(int(v)) for v in shape.cpu())
            if (hi_n, hi_code, lo_n, lo_code) != (n, code, n, code):
                raise BufferMismatch(
                    f"rank {self.rank} passed {n} x {_DTYPES[code]} to all_reduce, lengths span {lo_n}.."
                    f"{hi_n}, dtypes {_DTYPES[lo_code]}..{_DTYPES[hi_code]}: every rank must pass a buffer "
                    "of the same length and dtype to a collective")
            dist.all_reduce(t, async_op=True).wait(self._td)
        if op == "mean":
            t /= self.world_size
        if host is not None:
            host.copy_(t)

    def barrier(self) -> None:
        with self._explain(list(range(self.world_size)), "at a barrier"):
            _torch()[1].barrier(async_op=True).wait(self._td)

    def allgather_object(self, obj: Any) -> list:
        """Everyone's ``obj``, pickled: the launcher's control path, never the data path."""
        out: list = [None] * self.world_size
        _torch()[1].all_gather_object(out, obj)
        return out

    def abort(self) -> None:
        """Leave now, waiting for nobody (NCCL kernels included): peers see the connection close."""
        self.close(getattr(_torch()[1].distributed_c10d, "_abort_process_group", None))

    def close(self, how: Callable[[], None] | None = None) -> None:
        if _torch()[1].is_initialized():
            (how or _torch()[1].destroy_process_group)()


def _code(t: Any) -> int:
    name = str(t.dtype).removeprefix("torch.")
    return _DTYPES.index(name) if name in _DTYPES else -1


def _data_tag(t: Any) -> int:
    """The gloo tag of a message of this shape: only a receive of the same shape can match it."""
    return (t.numel() * len(_DTYPES) + _code(t)) % HEADER_TAG
