"""The local backend: ranks are processes on one machine that talk through shared memory.

No setup, no engine: this is dplab's embedded default. ``LocalComm`` holds the calls; the work
is done by parts that each own their state: ``Mailboxes`` (descriptors and semaphores per pair
of ranks, and how a rank waits for them: ``mailboxes.py``) over the rank's ``Memory`` (its
segments, staging and views into peers' segments, ``memory.py``), and the one-shot native
all-reduce (``oneshot.py``). A send locates its buffer in shared memory (staging it if need be)
and posts a descriptor; the receiver reads, or adds, straight out of the sender's memory and
posts back "done".

Mismatches (the contract in ``dplab.reference.communicator``): ``check_buffer`` makes the
collective's code the tag of its messages, and every descriptor carries length, dtype and tag,
so a receiver compares all three at every message and raises ``CollectiveMismatch`` (another
collective, algorithm or root) or ``BufferMismatch`` (another length or dtype) naming both
ranks; a sender left waiting for its peer peeks at the peer's own waiting message, which names
two ranks that both only send. ``native`` carries the code of allreduce(native).
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

from dplab.backends.local.mailboxes import SLOTS, Mailboxes, Waiter, Wiring
from dplab.backends.local.oneshot import one_shot
from dplab.backends.local.shm import process_alive
from dplab.reference.communicator import (
    ANY_SOURCE,
    Collective,
    Communicator,
    RecvSpec,
    SendSpec,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.trace import Tracer

__all__ = ["LocalComm"]

# a collective's tag, once per (kind, algorithm, root)
_code = lru_cache(maxsize=4096)(Collective.code)
_NATIVE = Collective("allreduce", "native")


def _refuse_crowded_round(rank: int, sends: list[SendSpec], round: int, algorithm: str) -> None:
    """A round that posts more than SLOTS messages to one peer would wait for a free slot while the
    peer, posting its own round first, never receives: refuse it at once instead of timing out."""
    peer, count = max(Counter(s.peer for s in sends).items(), key=lambda pc: pc[1])
    if count > SLOTS:
        raise ConfigError(f"rank {rank}: {algorithm or 'the schedule'} round {round} posts "
                          f"{count} messages to rank {peer}, more than the local backend's "
                          f"{SLOTS} mailbox slots per peer: lower the algorithm's piece "
                          f"count (e.g. '{algorithm or 'pipelined_ring'}:{SLOTS}') or use the "
                          "mpi or torch backend")


class _SendRequest:
    def __init__(self, comm: LocalComm, dst: int, seq: int) -> None:
        self.comm, self.dst, self.seq = comm, dst, seq

    def wait(self) -> None:
        self.comm.mailboxes.wait_ack(self.dst, self.seq)


class _RecvRequest:
    def __init__(self, comm: LocalComm, buf: np.ndarray, src: int, tag: int) -> None:
        self.comm, self.buf, self.src, self.tag, self.source = comm, buf, src, tag, None

    def wait(self) -> int:
        if self.source is None:
            self.comm._complete_until(self)
        return self.source


class LocalComm(Communicator):
    """A rank of the local backend: ``mailboxes`` (over ``memory``) do the
    work, this class the calls."""

    backend = "local"

    def __init__(self, wiring: Wiring, rank: int) -> None:
        self.w, self.rank, self.world_size = wiring, rank, wiring.world_size
        self.tracer = Tracer(rank)
        self.mailboxes = Mailboxes(wiring, rank, Waiter(rank, wiring.world_size, wiring.timeout))
        self.memory = self.mailboxes.memory
        self._pending: dict[int, deque[_RecvRequest]] = {
            s: deque() for s in range(-1, self.world_size)}
        self._tag = 0  # the tag of the running collective's messages (its code; see check_buffer)
        if wiring.pids is not None:
            wiring.pids[rank] = os.getpid()  # for peer_alive: dead or merely slow?

    @property
    def timeout(self) -> float:
        return self.mailboxes.waiter.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.mailboxes.waiter.timeout = seconds

    @property
    def bytes_staged(self) -> int:
        """Bytes copied because a send buffer was not in shared memory (the engine adds its own)."""
        return self.memory.bytes_staged

    @bytes_staged.setter
    def bytes_staged(self, n: int) -> None:
        self.memory.bytes_staged = n

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        return self.memory.empty(shape, dtype)

    # -- liveness -----------------------------------------------------------------------------
    def peer_alive(self, rank: int) -> bool:
        """False once ``rank``'s process has died (a SIGKILL included); unknown counts as alive."""
        pid = int(self.w.pids[rank]) if self.w.pids is not None else 0
        return pid == 0 or process_alive(pid)

    @contextmanager
    def patience(self, seconds: float) -> Iterator[None]:
        """Blocking calls inside give up after ``seconds``; a timed-out call consumed nothing."""
        saved, self.timeout = self.timeout, min(seconds, self.timeout)
        try:
            yield
        finally:
            self.timeout = saved

    # -- point to point -----------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dst: int, tag: int = 0) -> _SendRequest:
        return _SendRequest(self, dst, self.mailboxes.send(buf, dst, tag))

    def irecv(self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = 0) -> _RecvRequest:
        self.mailboxes.check_peer(src, any_ok=True)
        req = _RecvRequest(self, buf, src, tag)
        self._pending[src].append(req)
        return req

    def _complete_until(self, req: _RecvRequest) -> None:
        queue = self._pending[req.src]
        while req.source is None:
            head = queue.popleft()
            head.source = self.mailboxes.receive(head.buf, head.src, head.tag, reduce=False)

    # -- rounds and collectives ---------------------------------------------------------------
    def check_buffer(self, buf: np.ndarray, call: Collective | None = None) -> None:
        """The collective's messages carry its code as their tag (length
        and dtype they carry anyway)."""
        self._tag = _code(call) if call is not None else 0

    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """Post every send, then reduce or copy each receive straight out of the peer's memory."""
        # every rank posting before it receives: more than SLOTS to one peer deadlock
        if len(sends) > SLOTS:
            _refuse_crowded_round(self.rank, sends, round, algorithm)
        tr, tag = self.tracer, self._tag if round >= 0 else 0
        mailboxes = self.mailboxes
        send, receive, wait_ack = mailboxes.send, mailboxes.receive, mailboxes.wait_ack
        if not tr.enabled:  # the hot path: no clocks, no events, methods looked up once
            seqs = [send(s[0], s[1], tag) for s in sends]
            for r in recvs:
                receive(r[0], r[1], tag, r[3])
            for s, seq in zip(sends, seqs):
                wait_ack(s[1], seq, tag)
            return
        posted = [(s, send(s.buf, s.peer, tag), tr.now()) for s in sends]
        for r in recvs:
            t0 = tr.now()
            receive(r.buf, r.peer, tag, r.reduce)
            tr.record("reduce" if r.reduce else "copy", t0, tr.now(), peer=r.peer,
                      bytes=r.buf.nbytes, chunk=r.chunk, round=round, algorithm=algorithm)
        for s, seq, t0 in posted:
            wait_ack(s.peer, seq, tag)
            tr.record("send", t0, tr.now(), peer=s.peer, bytes=s.buf.nbytes, chunk=s.chunk,
                      round=round, algorithm=algorithm)

    def native_allreduce(self, buf: np.ndarray, op: str = "sum", check: bool = True) -> None:
        """No engine here: the native all-reduce is the one-shot shared-memory all-reduce
        (``oneshot.py``: each rank reduces its chunk in every rank's buffer), under the name
        ``native`` (a peer that called ring is told that this rank called native)."""
        require_writable(buf)
        if op not in ("sum", "mean") or (op == "mean" and buf.dtype.kind != "f"):
            raise ConfigError(f"op must be 'sum' or 'mean' (floating point only), got {op!r} "
                              f"for {buf.dtype}")
        if not buf.flags.c_contiguous:
            raise ConfigError("collectives work in place on contiguous arrays: use "
                              "np.ascontiguousarray")
        flat = buf.reshape(-1)
        self.check_buffer(flat, _NATIVE)
        if self.world_size > 1:
            one_shot(self.mailboxes, self.memory, flat, self._tag, self.tracer)
        if op == "mean" and self.world_size > 1:
            flat /= self.world_size

    def close(self) -> None:
        self.mailboxes.close()
