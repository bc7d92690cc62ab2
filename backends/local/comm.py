"""The local backend: ranks are processes on one machine that talk through shared memory.

No setup, no engine: this is dplab's embedded default. Each rank owns named
shared-memory segments (``comm.empty`` allocates there, like registered memory in
NCCL or MPI_Alloc_mem). Sending a buffer that lives in a segment costs no copy at
all: the sender writes a descriptor (segment, offset, bytes, dtype, tag) into the
pair's mailbox and posts a semaphore; the receiver reads, or adds, straight out of
the sender's memory and posts back "done". A buffer outside the segments is first
copied into a staging segment (one copy of the bytes sent).

Each ordered pair (src, dst) has its own mailbox of SLOTS descriptors and two
semaphores, so ranks signal only the peer they talk to (no global barrier per
round). ``arrival[dst]`` is posted with every message so ANY_SOURCE receives can
sleep until something comes. Messages between two ranks are matched in order;
tags are checked, not used to pick a message. A collective's messages are tagged with the
collective's code (``check_buffer``), so a rank that called another collective, algorithm or
root is named at the first message it receives; a rank that only sends and waits for a peer
to take its message looks at the peer's own waiting message (its tag) now and then, which
catches two ranks that both only send.

A small message's time is Python, not bytes (``dplab bench --backends local,mpi --sizes 4K``), so
the hot path keeps it short: descriptors go through a flat int64 memoryview of the mailboxes,
the views into a peer's segment are made once per chunk and kept (``memory.py``), and a wait
spins briefly before it sleeps (``waits.py``). ``native`` is one round in which each rank
reduces its chunk in every rank's buffer, writing into peers' memory (``oneshot.py``).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

from dplab.backends.local.memory import PEER_CACHE, SegmentMemory
from dplab.backends.local.oneshot import OneShot
from dplab.backends.local.shm import Segment
from dplab.backends.local.waits import Waits, wait_policy
from dplab.backends.local.wiring import CODE, DESC, DTYPES, SLOTS, Wiring, process_alive
from dplab.reference.communicator import (
    ANY_SOURCE,
    COLLECTIVE_TAG,
    BufferMismatch,
    Collective,
    CommError,
    Communicator,
    RecvSpec,
    SendSpec,
    collective_mismatch,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.trace import Tracer

__all__ = ["Wiring", "LocalComm", "PEER_CACHE"]

ANY_TAG = -1
_DTYPES, _CODE, _DESC = DTYPES, CODE, DESC  # the mailboxes' descriptor layout (wiring.py)
_code = lru_cache(maxsize=4096)(Collective.code)  # a collective's tag, once per (kind, algorithm, root)
_NATIVE = Collective("allreduce", "native")


def _refuse_crowded_round(rank: int, sends: list[SendSpec], round: int, algorithm: str) -> None:
    """A round that posts more than SLOTS messages to one peer would wait for a free slot while the
    peer, posting its own round first, never receives: refuse it at once instead of timing out."""
    peer, count = max(Counter(s.peer for s in sends).items(), key=lambda pc: pc[1])
    if count > SLOTS:
        raise ConfigError(f"rank {rank}: {algorithm or 'the schedule'} round {round} posts {count} messages "
                          f"to rank {peer}, more than the local backend's {SLOTS} mailbox slots per peer: "
                          f"lower the algorithm's piece count (e.g. '{algorithm or 'pipelined_ring'}:{SLOTS}'"
                          ") or use the mpi or torch backend")


class _SendRequest:
    def __init__(self, comm: LocalComm, dst: int, seq: int) -> None:
        self.comm, self.dst, self.seq = comm, dst, seq

    def wait(self) -> None:
        self.comm._wait_ack(self.dst, self.seq)


class _RecvRequest:
    def __init__(self, comm: LocalComm, buf: np.ndarray, src: int, tag: int) -> None:
        self.comm, self.buf, self.src, self.tag, self.source = comm, buf, src, tag, None

    def wait(self) -> int:
        if self.source is None:
            self.comm._complete_until(self)
        return self.source


class LocalComm(SegmentMemory, Waits, OneShot, Communicator):
    backend = "local"

    def __init__(self, wiring: Wiring, rank: int) -> None:
        self.w, self.rank, self.world_size = wiring, rank, wiring.world_size
        self.timeout = wiring.timeout
        self.tracer = Tracer(rank)
        p = self.world_size
        self._ctl_seg = Segment(f"{wiring.session}_ctl")
        # the mailboxes as bytes: message seq from src to dst is the 5 int64 at _slot(src, dst, seq).
        # One struct call reads or writes them in ~0.1 µs, where numpy's indexing costs a microsecond.
        self._ctl = self._ctl_seg.bytes[:p * p * SLOTS * _DESC.size].data
        # this rank's semaphores per peer, looked up once: ready to / from it, done to / from it
        w, me = wiring, rank
        self._ready_to = [w.ready[me][d] for d in range(p)]
        self._ready_from = [w.ready[s][me] for s in range(p)]
        self._done_to, self._done_from = [w.done[s][me] for s in range(p)], [w.done[me][d] for d in range(p)]
        self._segments: dict[int, Segment] = {}  # mine, by id (ids are never reused)
        self._ranges: dict[int, tuple[int, int]] = {}  # id -> (address, size) of each of mine
        self._last_range: tuple[int, int, int] = (-1, 0, 0)  # (id, address, size) last found by _locate
        self._peers: OrderedDict[tuple[int, int], Segment] = OrderedDict()  # (rank, id), LRU
        self._views: dict[tuple, np.ndarray] = {}  # (rank, id, offset, bytes, dtype) -> view
        self._send_seq, self._acked, self._recv_seq = [0] * p, [0] * p, [0] * p
        self._staging: tuple[int, int] = (-1, 0)  # (segment id, capacity)
        self._stage_top = 0  # bump pointer into the staging segment
        self._staged_seqs: deque[tuple[int, int]] = deque()  # (dst, seq) of staged sends not yet acked
        self._pending: dict[int, deque[_RecvRequest]] = {s: deque() for s in range(-1, p)}
        self._any_next = 0
        self._tag = 0  # the tag of the running collective's messages (its code; see check_buffer)
        self._next_id = 0
        self._spin, self._yields = wait_policy(p)
        self._budget, self._waits = self._spin, 0  # the spin now (waits.py) and waits so far
        self.bytes_staged = 0  # copies made because a send buffer was not in shared memory
        if wiring.pids is not None:
            wiring.pids[rank] = os.getpid()  # for peer_alive: dead or merely slow?

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
        return _SendRequest(self, dst, self._post(buf, dst, tag))

    def irecv(self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = 0) -> _RecvRequest:
        self._check_peer(src, any_ok=True)

        req = _RecvRequest(self, buf, src, tag)
        self._pending[src].append(req)
        return req

    def _post(self, buf: np.ndarray, dst: int, tag: int) -> int:
        if not 0 <= dst < self.world_size or dst == self.rank:
            self._check_peer(dst)
        code = _CODE.get(buf.dtype)
        if code is None or not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: send needs a contiguous array of one of "
                            f"{', '.join(map(str, _CODE))}; got {buf.dtype}, "
                            f"contiguous={buf.flags.c_contiguous}")
        seq = self._send_seq[dst]
        if seq - self._acked[dst] >= SLOTS:
            self._wait_ack(dst, seq - SLOTS)
        seg_id, off, staged = self._locate(buf)
        i = ((self.rank * self.world_size + dst) * SLOTS + seq % SLOTS) * _DESC.size  # _slot, inlined
        _DESC.pack_into(self._ctl, i, seg_id, off, buf.nbytes, code, tag)
        self._send_seq[dst] = seq + 1
        if staged:
            self._staged_seqs.append((dst, seq))
        self._ready_to[dst].release()
        self.w.arrival[dst].release()
        return seq

    def _slot(self, src: int, dst: int, seq: int) -> int:
        """Where the descriptor of message ``seq`` from ``src`` to ``dst`` starts in ``_ctl``."""
        return ((src * self.world_size + dst) * SLOTS + seq % SLOTS) * _DESC.size

    def _wait_ack(self, dst: int, seq: int, peek: bool = False) -> None:
        done = self._done_from[dst]
        while self._acked[dst] <= seq:
            if not done.acquire(False):
                self._acquire(done, "to take its message", dst, peek)
            self._acked[dst] += 1
        while self._staged_seqs and self._acked[self._staged_seqs[0][0]] > self._staged_seqs[0][1]:
            self._staged_seqs.popleft()

    def _complete_until(self, req: _RecvRequest) -> None:
        queue = self._pending[req.src]
        while req.source is None:
            head = queue.popleft()
            head.source = self._recv_into(head.buf, head.src, head.tag, reduce=False)

    def _recv_into(self, buf: np.ndarray, src: int, tag: int, reduce: bool) -> int:
        me = self.rank
        if src == ANY_SOURCE:
            src = self._wait_any()
        elif not self._ready_from[src].acquire(False):
            self._acquire(self._ready_from[src], "for its message", src)
        seq = self._recv_seq[src]
        i = ((src * self.world_size + me) * SLOTS + seq % SLOTS) * _DESC.size  # _slot, inlined
        seg_id, off, nbytes, code, mtag = _DESC.unpack_from(self._ctl, i)
        self._recv_seq[src] = seq + 1
        try:
            if mtag != tag and tag != ANY_TAG:
                self._refuse(buf, src, tag, mtag, nbytes, code)
            if buf.nbytes != nbytes or buf.dtype is not _DTYPES[code] and buf.dtype != _DTYPES[code]:
                self._refuse(buf, src, tag, mtag, nbytes, code)
            if nbytes:
                peer = self._peer_view(src, seg_id, off, nbytes, _DTYPES[code])
                if buf.ndim != 1:
                    peer = peer.reshape(buf.shape)
                if reduce:  # buf may be any view, strided or not: numpy writes through it
                    np.add(buf, peer, out=buf)
                else:
                    np.copyto(buf, peer)
        finally:
            self._done_to[src].release()
        return src

    def _refuse(self, buf: np.ndarray, src: int, tag: int, mtag: int, nbytes: int, code: int) -> None:
        """The error for a message that does not fit the receive: another collective, another buffer
        or another tag, in that order (a rank in another collective may well send another length)."""
        me, dtype = self.rank, _DTYPES[code]
        if mtag != tag and tag != ANY_TAG and max(tag, mtag) >= COLLECTIVE_TAG:
            raise collective_mismatch(me, tag, src, mtag)
        if buf.nbytes != nbytes or buf.dtype != dtype:
            raise BufferMismatch(
                f"rank {me} expected {buf.size} x {buf.dtype} from rank {src} but rank {src} sent "
                f"{nbytes // dtype.itemsize} x {dtype}: every rank must pass a buffer of the same "
                "length and dtype to a collective")
        raise CommError(f"rank {me} expected tag {tag} from rank {src}, got tag {mtag}: "
                        "messages between two ranks are matched in order")

    def _check_peer(self, peer: int, any_ok: bool = False) -> None:
        if any_ok and peer == ANY_SOURCE:
            return
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CommError(f"rank {self.rank}: peer {peer} is not another rank of a world of "
                            f"size {self.world_size}")

    # -- rounds and collectives ---------------------------------------------------------------
    def check_buffer(self, buf: np.ndarray, call: Collective | None = None) -> None:
        """The collective's messages carry its code as their tag (length and dtype they carry anyway)."""
        self._tag = _code(call) if call is not None else 0

    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """Post every send, then reduce or copy each receive straight out of the peer's memory."""
        if len(sends) > SLOTS:  # every rank posting before it receives: more than SLOTS to one peer deadlock
            _refuse_crowded_round(self.rank, sends, round, algorithm)
        tr, tag = self.tracer, self._tag if round >= 0 else 0
        peek = tag >= COLLECTIVE_TAG
        if not tr.enabled:  # the hot path: no clocks, no events, methods looked up once
            post, recv_into, wait_ack = self._post, self._recv_into, self._wait_ack
            seqs = [post(s[0], s[1], tag) for s in sends]
            for r in recvs:
                recv_into(r[0], r[1], tag, r[3])
            for s, seq in zip(sends, seqs):
                wait_ack(s[1], seq, peek)
            return
        posted = [(s, self._post(s.buf, s.peer, tag), tr.now()) for s in sends]
        for r in recvs:
            t0 = tr.now()
            self._recv_into(r.buf, r.peer, tag, r.reduce)
            tr.record("reduce" if r.reduce else "copy", t0, tr.now(), peer=r.peer,
                      bytes=r.buf.nbytes, chunk=r.chunk, round=round, algorithm=algorithm)
        for s, seq, t0 in posted:
            self._wait_ack(s.peer, seq, peek)
            tr.record("send", t0, tr.now(), peer=s.peer, bytes=s.buf.nbytes, chunk=s.chunk,
                      round=round, algorithm=algorithm)

    def native_allreduce(self, buf: np.ndarray, op: str = "sum", check: bool = True) -> None:
        """No engine here: the native all-reduce is the one-shot shared-memory all-reduce
        (``oneshot.py``: each rank reduces its chunk in every rank's buffer), under the name
        ``native`` (a peer that called ring is told that this rank called native)."""
        require_writable(buf)
        if op not in ("sum", "mean") or (op == "mean" and buf.dtype.kind != "f"):
            raise ConfigError(f"op must be 'sum' or 'mean' (floating point only), got {op!r} for {buf.dtype}")
        if not buf.flags.c_contiguous:
            raise ConfigError("collectives work in place on contiguous arrays: use np.ascontiguousarray")
        flat = buf.reshape(-1)
        self.check_buffer(flat, _NATIVE)
        if self.world_size > 1:
            self._one_shot(flat)
        if op == "mean" and self.world_size > 1:
            flat /= self.world_size

    def close(self) -> None:
        self._views.clear()
        self._ctl.release()
        for seg in [*self._peers.values(), *self._segments.values(), self._ctl_seg]:
            seg.close()
        self._peers.clear()
