"""The cuda backend: ranks are threads of one process, on one GPU or several.

    dplab train --backend cuda --world-size 4       # four ranks on one GPU (or one per GPU)
    dplab bench --backends cuda --world-sizes 2,4 --sizes 4K,256M

Rank r computes on GPU ``r % device_count``. A receive reads straight from the sender's tensor: the
host passes each message's view and an acknowledgement back (``hub.py``) and never waits for the
device. Ranks on one GPU share its stream, so enqueue order is kernel order and no CUDA event is
needed; across GPUs the receiver waits on the sender's ``ready`` event, the sender on the receiver's
``consumed`` one. Torch tensors stay on the rank's GPU; numpy arrays travel in host memory.
``native`` is a one-shot on device memory: rank d adds chunk d of every rank's buffer (in the order
d, d+1, ..., d-1) and writes the sum into every buffer's chunk d. Mismatch contract: each message
carries its collective's code and the buffer's (length, dtype), compared by the receiver (1, 2); a
waiting rank sees a peer's pending message of another collective (3). Why threads:
backends/README.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dplab.backends.cuda.hub import Hub, Message
from dplab.reference.communicator import (
    ANY_SOURCE,
    BufferMismatch,
    Collective,
    Communicator,
    RecvSpec,
    SendSpec,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.trace import Tracer

__all__ = ["CudaComm"]

_NATIVE = Collective("allreduce", "native")


class _Request:
    def __init__(self, wait: Any) -> None:
        self._wait, self._result, self._done = wait, None, False

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done = self._wait(), True
        return self._result


class CudaComm(Communicator):
    """One rank thread; ``devices``: every rank's GPU (the CPU only in
    this transport's CPU tests)."""

    backend, moves_tensors = "cuda", True

    def __init__(self, hub: Hub, devices: list[Any], rank: int) -> None:
        import torch

        self.torch, self.hub, self.rank, self.world_size = torch, hub, rank, hub.world_size
        device = devices[rank]
        self.timeout, self.tracer, self.device = hub.timeout, Tracer(rank), device
        self.cuda = device.type == "cuda"
        self.stream = None
        self.events = False  # CUDA events between ranks: only when some rank is on another GPU
        if self.cuda:
            try:
                torch.cuda.set_device(device)
            except RuntimeError as e:
                if ("initialization error" not in str(e)
                        and "re-initialize CUDA in forked" not in str(e)):
                    raise
                raise ConfigError(
                    "CUDA cannot start in the cuda world's process: the process "
                    "that started it had started CUDA before forking "
                    "(torch.manual_seed, torch.cuda.is_available() and any GPU "
                    "tensor do): start the world first, and seed with "
                    "torch.default_generator.manual_seed or a torch.Generator"
                ) from None
            self.stream = torch.cuda.default_stream(device)  # shared by every rank on this GPU
            self.events = any(d != device for d in devices)
        # Backward runs in this thread, not in autograd's one worker thread per GPU that all ranks
        # share: DDP and FSDP wait for their peers inside backward, which would block that worker
        # (and so every other rank's backward) for good.
        torch.autograd.set_multithreading_enabled(False)
        self._code, self._facts = 0, None  # the current collective's code and buffer facts

    # -- the collective being run -----------------------------------------------------------------
    def check_buffer(self, buf: Any, call: Collective | None = None) -> None:
        self._code = 0 if call is None else call.code()
        self._facts = _facts(buf)

    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """One round: post every send (a view and its ready event), apply every receive, then
        wait until the peers have read what this rank sent."""
        tag, facts = (self._code, self._facts) if round >= 0 else (0, None)
        with self._on_stream():
            ready = self._event()
            posted = [self.hub.post(Message(self.rank, s.peer, (tag, round, s.chunk), s.buf, ready,
                                            facts))
                      for s in sends]
            for r in recvs:
                t0 = self.tracer.now()
                msg = self.hub.take(self.rank, r.peer, (tag, round, r.chunk))
                self._check(msg, r.buf, facts)
                self._apply(r.buf, msg.data, msg.ready, r.reduce)
                self.hub.ack(msg, self._event())
                self._trace("reduce" if r.reduce else "copy", t0, r, round, algorithm)
            for msg, s in zip(posted, sends):
                t0 = self.tracer.now()
                self._after(self.hub.wait_ack(self.rank, msg))
                self._trace("send", t0, s, round, algorithm)

    def native_allreduce(self, buf: Any, op: str = "sum", check: bool = True) -> None:
        """One round: rank d sums chunk d of every buffer and writes it back into every buffer."""
        if op != "sum":
            raise ConfigError(f"native_allreduce sums; got op={op!r}")
        flat = buf.reshape(-1) if isinstance(buf, np.ndarray) else buf.view(-1)
        require_writable(flat)
        me, p = self.rank, self.world_size
        facts = _facts(flat) if check else None
        key = (_NATIVE.code(), 0, -1)
        with self._on_stream():
            ready = self._event()
            posted = [self.hub.post(Message(me, d, key, flat, ready, facts))
                      for d in range(p) if d != me]
            # d + 1, ..., d - 1: every rank sums in one order
            order = (*range(me + 1, p), *range(me))
            taken = [self.hub.take(me, src, key) for src in order]
            for msg in taken:
                self._check(msg, flat, facts)
                self._after(msg.ready)
            lo, hi = chunk_bounds(len(flat), p)[me]
            mine = flat[lo:hi]
            for msg in taken:
                self._apply(mine, msg.data[lo:hi], None, True)
            for msg in taken:
                self._apply(msg.data[lo:hi], mine, None, False)
            done = self._event()
            for msg in taken:
                self.hub.ack(msg, done)  # this rank is done with that peer's buffer
            for msg in posted:
                self._after(self.hub.wait_ack(me, msg))  # peers wrote their chunks into ours

    # -- point to point ---------------------------------------------------------------------------
    def isend(self, buf: Any, dst: int, tag: int = 0) -> _Request:
        with self._on_stream():
            msg = self.hub.post(Message(self.rank, dst, (tag, -1, -1), buf, self._event(), None))
        return _Request(lambda: self._after(self.hub.wait_ack(self.rank, msg)))

    def irecv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0) -> _Request:
        def receive() -> int:
            with self._on_stream():
                msg = self.hub.take(self.rank, src, (tag, -1, -1))
                self._check(msg, buf, None)
                self._apply(buf, msg.data, msg.ready, False)
                self.hub.ack(msg, self._event())
            return msg.src

        return _Request(receive)

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def _trace(self, kind: str, t0: int, spec: Any, round: int, algorithm: str) -> None:
        """A transfer in the trace, as every backend records it (host
        time: the device runs later)."""
        if self.tracer.enabled:
            buf = spec.buf
            nbytes = buf.nbytes if isinstance(buf, np.ndarray) else buf.numel() * buf.element_size()
            self.tracer.record(kind, t0, self.tracer.now(), peer=spec.peer, bytes=nbytes,
                               chunk=spec.chunk, round=round, algorithm=algorithm)

    # -- device work -------------------------------------------------------------------------------
    def _on_stream(self) -> Any:
        """Run on the rank's stream, ordered after the caller's (a DDP comm thread has its own)."""
        return _Stream(self)

    def _event(self) -> Any:
        """An event at this point of the rank's stream; None where the stream's order is enough
        (every rank on one GPU) or there is nothing to wait for (host memory)."""
        if not self.events:
            return None
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def _after(self, event: Any) -> None:
        """The rank's stream waits for ``event`` (a peer's ready or consumed point)."""
        if event is not None:
            self.stream.wait_event(event)

    def _apply(self, dst: Any, src: Any, ready: Any, reduce: bool) -> None:
        """``dst += src`` or ``dst[:] = src`` on this rank's stream, once ``src`` is ready."""
        if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
            np.add(dst, src, out=dst) if reduce else np.copyto(dst, src)
            return
        torch = self.torch
        self._after(ready)
        d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
        s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
        if reduce:
            d.add_(s if s.device == d.device else s.to(d.device))
        else:
            d.copy_(s)
        if d.device.type == "cpu" and self.cuda and s.device.type == "cuda":
            # a host buffer is read by the host next: the copy must be there
            self.stream.synchronize()

    def _check(self, msg: Message, buf: Any, facts: Any) -> None:
        """Clause 2 of the mismatch contract: the same buffer (length, dtype) on both ranks."""
        theirs = msg.facts if facts is not None else _facts(msg.data)
        mine = facts if facts is not None else _facts(buf)
        if theirs != mine or len(msg.data) != len(buf):
            raise BufferMismatch(
                f"rank {self.rank} expected {mine[0]} x {mine[1]} from rank {msg.src} but "
                f"rank {msg.src} sent {theirs[0]} x {theirs[1]}: every rank must pass a buffer "
                "of the same length and dtype to a collective")


def _facts(buf: Any) -> tuple[int, str]:
    """(length, dtype) of a numpy array or torch tensor: what two ranks' buffers must agree on."""
    return len(buf), str(buf.dtype).removeprefix("torch.")


class _Stream:
    """``with comm._on_stream():`` the GPU's shared stream is current, after the caller's stream
    (a rank computing on a stream of its own: FSDP's prefetch)."""

    def __init__(self, comm: CudaComm) -> None:
        self.comm, self.caller, self.ctx = comm, None, None

    def __enter__(self) -> None:
        comm = self.comm
        if not comm.cuda:
            return
        torch = comm.torch
        caller = torch.cuda.current_stream(comm.device)
        if caller != comm.stream:
            comm.stream.wait_stream(caller)
            self.caller = caller
            self.ctx = torch.cuda.stream(comm.stream)
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.caller is not None:
            self.ctx.__exit__(*exc)
            self.caller.wait_stream(self.comm.stream)
