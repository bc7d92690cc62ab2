"""The local backend's mailboxes: how a rank's messages reach a peer and are taken.

Each ordered pair (src, dst) has a mailbox of ``SLOTS`` descriptors (segment id, offset, bytes,
dtype code, tag) in the world's control segment, and two semaphores: ``ready[src][dst]`` (a
descriptor waits) and ``done[src][dst]`` (dst has finished with the message); ``arrival[dst]`` is
posted with every message for receives from ANY_SOURCE. A receive copies or adds straight out of
the sender's memory. Messages between two ranks are taken in order; tags, lengths and dtypes are
checked, not used to pick a message (``refusal``), and a waiting sender ``peek``s at its peer's
message to report a mismatch instead of timing out. The launcher makes what ranks share before
the fork (``Wiring``), with each rank's pid, so ``LocalComm.peer_alive`` tells dead from slow.
A rank waits (``Waiter``) by a bounded, adaptive spin (``DPLAB_SPIN_US``), then sleep, never past
its timeout; when ranks outnumber cores it sleeps at once (``DPLAB_YIELDS`` > 0: yield first).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from dplab.backends.local.memory import Memory
from dplab.backends.local.shm import Segment
from dplab.reference.communicator import (
    ANY_SOURCE,
    COLLECTIVE_TAG,
    BufferMismatch,
    CommError,
    CommTimeout,
    collective_mismatch,
)

__all__ = ["Mailboxes", "Wiring", "Waiter", "wait_policy", "refusal", "ANY_TAG", "SLOTS", "DESC",
           "DTYPES", "CODE", "SPIN_US", "PEEK_S"]

SLOTS = 64  # descriptors in each (src, dst) mailbox
DESC = struct.Struct("5q")  # a message's descriptor: segment id, offset, bytes, dtype code, tag
DTYPES = [np.dtype(t) for t in ("uint8", "float32", "float64", "int32", "int64", "float16")]
CODE = {dt: i for i, dt in enumerate(DTYPES)}  # a dtype's code in a descriptor
SPIN_US = 20  # how long a wait spins at most before it sleeps, when every rank has a core
PEEK_S = (1e-3, 0.25)  # a waiter with a peek sleeps this long first, then doubles up to the second

ANY_TAG = -1
_TAG = struct.Struct("q")  # the last of a descriptor's five int64
_TAG_AT = 4 * 8  # its offset in the descriptor


@dataclass
class Wiring:
    """Semaphores, the control segment's name, and the ranks' pids (0 until a rank connects)."""

    session: str
    world_size: int
    timeout: float
    ready: list  # ready[src][dst]: a descriptor from src waits in dst's mailbox
    done: list  # done[src][dst]: dst has finished reading a message of src
    arrival: list  # arrival[dst]: some message waits for dst
    pids: Any = None  # shared int64 array: pids[r] is rank r's process id

    @classmethod
    def create(cls, ctx: BaseContext, session: str, p: int, timeout: float) -> Wiring:
        ctl = Segment(f"{session}_ctl", p * p * SLOTS * DESC.size, create=True)
        ctl.close()
        sems = [[ctx.Semaphore(0) for _ in range(p)] for _ in range(2 * p)]
        return cls(session, p, timeout, sems[:p], sems[p:], [ctx.Semaphore(0) for _ in range(p)],
                   ctx.Array("q", p, lock=False))


def wait_policy(world_size: int) -> tuple[float, int]:
    """(seconds of spin, yields) before a wait sleeps: spin with a core per rank, else neither."""
    own_core = world_size <= len(os.sched_getaffinity(0))
    spin = float(os.environ.get("DPLAB_SPIN_US", SPIN_US)) * 1e-6 if own_core else 0.0
    return spin, 0 if own_core else int(os.environ.get("DPLAB_YIELDS", "0"))


class Waiter:
    """One rank's way of waiting on a semaphore: its spin budget, its yields and its timeout."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.spin, self.yields = wait_policy(world_size)
        self.budget, self.waits = self.spin, 0  # the spin now, and waits so far

    def acquire(self, sem: Any, what: str, peer: int,
                peek: Callable[[], None] | None = None) -> None:
        """Take ``sem`` (``peer`` is to post it, ``what`` says what for) or raise ``CommTimeout``.
        ``peek``, if given, is called between sleeps and may raise to stop the wait."""
        if self.spin and self._spin_for(sem):
            return
        for _ in range(self.yields):
            if sem.acquire(False):
                return
            os.sched_yield()
        if self._sleep_for(sem, peek):
            return
        raise CommTimeout(f"rank {self.rank} waited {self.timeout:.0f}s for rank {peer} {what}: "
                          "is that rank dead or stuck? (set DPLAB_TIMEOUT to wait longer)")

    def _spin_for(self, sem: Any) -> bool:
        """Try ``sem`` for the spin budget; a spin that fails halves the next one."""
        self.waits += 1  # every 8th wait spins in full: is the peer quick again?
        budget, clock = self.spin if self.waits % 8 == 0 else self.budget, time.perf_counter
        end = clock() + budget
        while clock() < end:
            for _ in range(8):  # a try costs about as much as a clock read
                if sem.acquire(False):
                    self.budget = self.spin
                    return True
        self.budget = max(budget / 2, self.spin / 16)  # the peer is slow, or has no core: back off
        return False

    def _sleep_for(self, sem: Any, peek: Callable[[], None] | None) -> bool:
        """Sleep on ``sem`` until the timeout, in doubling slices with ``peek`` between them."""
        if peek is None:
            return sem.acquire(timeout=self.timeout)
        deadline, nap = time.monotonic() + self.timeout, PEEK_S[0]
        while True:
            left = deadline - time.monotonic()
            if sem.acquire(timeout=max(min(nap, left), 0)):
                return True
            if left <= nap:
                return False
            peek()
            nap = min(2 * nap, PEEK_S[1])


class Mailboxes:
    """One rank's ends of every mailbox: descriptors, semaphores and sequence numbers, over the
    rank's ``memory``. ``send_seq[d]`` messages were posted to d, ``acked[d]`` of them taken;
    ``recv_seq[s]`` taken from s."""

    def __init__(self, wiring: Wiring, rank: int, waiter: Waiter) -> None:
        p, me = wiring.world_size, rank
        self.rank, self.world_size, self.waiter = rank, p, waiter
        self._seg = Segment(f"{wiring.session}_ctl")
        # A flat view of the descriptors: struct reads
        # and writes one in place, unlike numpy indexing.
        self._ctl = self._seg.bytes[:p * p * SLOTS * DESC.size].data
        self._ready_to = [wiring.ready[me][d] for d in range(p)]
        self._ready_from = [wiring.ready[s][me] for s in range(p)]
        self._done_to = [wiring.done[s][me] for s in range(p)]
        self._done_from = [wiring.done[me][d] for d in range(p)]
        self._arrival = wiring.arrival
        self.send_seq, self.acked, self.recv_seq = [0] * p, [0] * p, [0] * p
        self._any_next = 0
        self.memory = Memory(wiring.session, rank, self.acked)

    def send(self, buf: np.ndarray, dst: int, tag: int) -> int:
        """Post ``buf`` (located in shared memory, staged if need be)
        to ``dst``; returns its seq."""
        if not 0 <= dst < self.world_size or dst == self.rank:
            self.check_peer(dst)
        code = CODE.get(buf.dtype)
        if code is None or not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: send needs a contiguous array of one of "
                            f"{', '.join(map(str, CODE))}; got {buf.dtype}, "
                            f"contiguous={buf.flags.c_contiguous}")
        seg_id, off, staged = self.memory.locate(buf)
        seq = self.post(dst, seg_id, off, buf.nbytes, code, tag)
        if staged:
            self.memory.staged_sent(dst, seq)
        return seq

    def receive(self, buf: np.ndarray, src: int, tag: int, reduce: bool) -> int:
        """Take the next message from ``src`` (or ANY_SOURCE), check it against ``buf`` and ``tag``,
        and copy or add it into ``buf`` straight out of the sender's memory; returns the source."""
        if src == ANY_SOURCE:
            src = self._wait_any()
        else:
            ready = self._ready_from[src]
            if not ready.acquire(False):
                self.waiter.acquire(ready, "for its message", src)
        seq = self.recv_seq[src]
        self.recv_seq[src] = seq + 1
        # _slot, inlined
        i = ((src * self.world_size + self.rank) * SLOTS + seq % SLOTS) * DESC.size
        seg_id, off, nbytes, code, mtag = DESC.unpack_from(self._ctl, i)
        try:
            dtype = DTYPES[code]
            if mtag != tag and tag != ANY_TAG or buf.nbytes != nbytes or buf.dtype is not dtype \
                    and buf.dtype != dtype:
                raise refusal(self.rank, buf, src, tag, mtag, nbytes, code)
            if nbytes:
                peer = self.memory.peer_view(src, seg_id, off, nbytes, dtype)
                if buf.ndim != 1:
                    peer = peer.reshape(buf.shape)
                if reduce:  # buf may be any view, strided or not: numpy writes through it
                    np.add(buf, peer, out=buf)
                else:
                    np.copyto(buf, peer)
        finally:
            self._done_to[src].release()
        return src

    def post(self, dst: int, seg_id: int, off: int, nbytes: int, code: int, tag: int) -> int:
        """Put a descriptor in ``dst``'s mailbox (waiting for a free slot);
        returns its sequence number."""
        seq = self.send_seq[dst]
        if seq - self.acked[dst] >= SLOTS:
            self.wait_ack(dst, seq - SLOTS)
        i = ((self.rank * self.world_size + dst) * SLOTS + seq % SLOTS) * DESC.size
        DESC.pack_into(self._ctl, i, seg_id, off, nbytes, code, tag)
        self.send_seq[dst] = seq + 1
        self._ready_to[dst].release()
        self._arrival[dst].release()
        return seq

    def take(self, src: int) -> tuple[int, int, int, int, int]:
        """Wait for the next message from ``src``: its (segment id, offset, bytes, dtype code, tag).
        The caller posts ``ack(src)`` once it has finished with the message."""
        ready = self._ready_from[src]
        if not ready.acquire(False):
            self.waiter.acquire(ready, "for its message", src)
        seq = self.recv_seq[src]
        self.recv_seq[src] = seq + 1
        return DESC.unpack_from(self._ctl,
                                ((src * self.world_size + self.rank) * SLOTS + seq % SLOTS)
                                * DESC.size)

    def ack(self, src: int) -> None:
        """Tell ``src`` that its message has been taken."""
        self._done_to[src].release()

    def wait_ack(self, dst: int, seq: int, tag: int = 0) -> None:
        """Wait until ``dst`` has taken message ``seq``; ``tag`` >=
        COLLECTIVE_TAG peeks meanwhile."""
        done = self._done_from[dst]
        while self.acked[dst] <= seq:
            if not done.acquire(False):
                peek = partial(self.peek, dst, tag, done) if tag >= COLLECTIVE_TAG else None
                self.waiter.acquire(done, "to take its message", dst, peek)
            self.acked[dst] += 1

    def peek(self, peer: int, tag: int, done: Any) -> None:
        """Waiting for ``peer`` to take a message of collective ``tag``: if ``peer`` has posted one
        of another collective to us, it is in that one (it cannot have finished ours without taking
        our message, and its earlier ones we took): raise ``CollectiveMismatch``. Unless it took
        ours since we last looked (``done`` posted, then its next collective's message): then that
        message is legitimately ahead of us and the ack is the waiter's to take."""
        if self._ready_from[peer].get_value() > 0:
            at = self._slot(peer, self.rank, self.recv_seq[peer]) + _TAG_AT
            mtag = _TAG.unpack_from(self._ctl, at)[0]
            if mtag != tag and mtag >= COLLECTIVE_TAG:
                if done.acquire(False):  # taken after all: give the ack back to the waiter
                    done.release()
                    return
                raise collective_mismatch(self.rank, tag, peer, mtag)

    def check_peer(self, peer: int, any_ok: bool = False) -> None:
        """CommError unless ``peer`` is another rank (or, with ``any_ok``, ANY_SOURCE)."""
        if any_ok and peer == ANY_SOURCE:
            return
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CommError(f"rank {self.rank}: peer {peer} is not another rank of a world of "
                            f"size {self.world_size}")

    def close(self) -> None:
        self.memory.close()
        self._ctl.release()
        self._seg.close()

    def _wait_any(self) -> int:
        """Take the ready semaphore of whichever peer has a message first, in turn."""
        me, p, waiter = self.rank, self.world_size, self.waiter
        deadline = time.monotonic() + waiter.timeout
        while True:
            for i in range(p):
                src = (self._any_next + i) % p
                if src != me and self._ready_from[src].acquire(False):
                    self._any_next = src + 1
                    return src
            left = deadline - time.monotonic()
            if left <= 0 or not self._arrival[me].acquire(timeout=left):
                raise CommTimeout(f"rank {me} waited {waiter.timeout:.0f}s for a message from any "
                                  "rank: is a peer dead or stuck? (set DPLAB_TIMEOUT to "
                                  "wait longer)")

    def _slot(self, src: int, dst: int, seq: int) -> int:
        """Where the descriptor of message ``seq`` from ``src`` to ``dst`` starts."""
        return ((src * self.world_size + dst) * SLOTS + seq % SLOTS) * DESC.size


def refusal(rank: int, buf: np.ndarray, src: int, tag: int, mtag: int, nbytes: int,
            code: int) -> CommError:
    """The error for a message that does not fit the receive: another collective, another buffer
    or another tag, in that order (a rank in another collective may well send another length)."""
    dtype = DTYPES[code]
    if mtag != tag and tag != ANY_TAG and max(tag, mtag) >= COLLECTIVE_TAG:
        return collective_mismatch(rank, tag, src, mtag)
    if buf.nbytes != nbytes or buf.dtype != dtype:
        return BufferMismatch(
            f"rank {rank} expected {buf.size} x {buf.dtype} from rank {src} but rank {src} sent "
            f"{nbytes // dtype.itemsize} x {dtype}: every rank must pass a buffer of the same "
            "length and dtype to a collective")
    return CommError(f"rank {rank} expected tag {tag} from rank {src}, got tag {mtag}: "
                     "messages between two ranks are matched in order")
