"""How a rank of the local backend waits: spin, maybe yield, then sleep, never past its timeout.

A semaphore post that finds its waiter asleep costs a futex wake-up, and the waiter tens of
microseconds to be scheduled again: more than a whole round of a small all-reduce. So a waiting
rank first tries the semaphore ``spin`` times (~0.1 µs each), which catches a peer that is a
few microseconds behind, and only then sleeps. Spinning is bounded and only pays while every
rank has a core of its own: when ranks outnumber cores (world size 4 or 8 on two cores) a
spinning rank takes the core from the very peer it waits for, so there it sleeps at once
(``yields`` > 0 would give the core away with ``sched_yield`` a few times first; measured
slower here, 1.5x at p=4, so off unless ``DPLAB_YIELDS`` asks). ``DPLAB_SPIN`` sets the spin.

A sender waiting for a collective's peer to take its message sleeps in doubling slices and
looks at the peer's own waiting message in between (``_peek``): two ranks that are both only
sending (each in another collective) are named at once instead of at the timeout.
``LocalComm`` (comm.py) holds the state these methods use (``w``, ``_ctl``, ``_tag``, ...).
"""

from __future__ import annotations

import os
import struct
import time

from dplab.reference.communicator import COLLECTIVE_TAG, CommTimeout, collective_mismatch

__all__ = ["Waits", "wait_policy", "SPIN", "PEEK_S"]

SPIN = 200  # semaphore tries before sleeping, when every rank has a core (~20 µs at most)
PEEK_S = (1e-3, 0.25)  # a sender waiting this long looks at the peer's own message, then doubles
_TAG = struct.Struct("q")  # the last of a descriptor's five int64 (comm.py's _DESC)


def wait_policy(world_size: int) -> tuple[int, int]:
    """(spins, yields) before a wait sleeps: spin with a core per rank, else neither (see above)."""
    own_core = world_size <= len(os.sched_getaffinity(0))
    spin = int(os.environ.get("DPLAB_SPIN", str(SPIN))) if own_core else 0
    return spin, 0 if own_core else int(os.environ.get("DPLAB_YIELDS", "0"))


class Waits:
    """The waiting half of ``LocalComm``."""

    def _wait_any(self) -> int:
        me, p = self.rank, self.world_size
        deadline = time.monotonic() + self.timeout
        while True:
            for i in range(p):
                src = (self._any_next + i) % p
                if src != me and self.w.ready[src][me].acquire(False):
                    self._any_next = src + 1
                    return src
            left = deadline - time.monotonic()
            if left <= 0 or not self.w.arrival[me].acquire(timeout=left):
                raise CommTimeout(f"rank {me} waited {self.timeout:.0f}s for a message from any "
                                  "rank: is a peer dead or stuck? (set DPLAB_TIMEOUT to wait longer)")

    def _acquire(self, sem, what: str, peer: int, peek: bool = False) -> None:
        """Spin briefly (a futex wake-up costs tens of microseconds), then sleep until the timeout;
        with ``peek`` (a collective's sender waiting for ``peer``), sleep in doubling slices and
        look at ``peer``'s waiting message in between (``_peek``)."""
        for _ in range(self._spin):
            if sem.acquire(False):
                return
        for _ in range(self._yields):
            if sem.acquire(False):
                return
            os.sched_yield()
        deadline, nap = time.monotonic() + self.timeout, PEEK_S[0]
        while peek and self._tag >= COLLECTIVE_TAG:
            left = deadline - time.monotonic()
            if sem.acquire(timeout=max(min(nap, left), 0)):
                return
            if left <= nap:
                break
            self._peek(peer, sem)
            nap = min(2 * nap, PEEK_S[1])
        else:
            if sem.acquire(timeout=self.timeout):
                return
        raise CommTimeout(f"rank {self.rank} waited {self.timeout:.0f}s for rank {peer} {what}: "
                          "is that rank dead or stuck? (set DPLAB_TIMEOUT to wait longer)")

    def _peek(self, peer: int, done) -> None:
        """Waiting for ``peer`` to take this collective's message: if ``peer`` has posted one of
        another collective to us, it is in that one (it cannot have finished ours without taking
        our message, and its earlier ones we took): both may only be sending, so say so now.
        Unless it took ours since we last looked (``done`` posted, then its next collective's
        message): then that message is legitimately ahead of us and the ack is ours to take."""
        if self.w.ready[peer][self.rank].get_value() > 0:
            mtag = _TAG.unpack_from(self._ctl, self._slot(peer, self.rank, self._recv_seq[peer]) + 32)[0]
            if mtag != self._tag and mtag >= COLLECTIVE_TAG:
                if done.acquire(False):  # taken after all: give the ack back to _acquire's caller
                    done.release()
                    return
                raise collective_mismatch(self.rank, self._tag, peer, mtag)
