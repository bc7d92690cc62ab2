"""How a rank of the local backend waits: spin, then sleep, never past its timeout.

A semaphore post that finds its waiter asleep costs a futex wake-up, and the waiter tens of
microseconds to be scheduled again: more than a whole round of a small all-reduce (a 4 KiB
all-reduce at p=2 took 75 µs with no spin, 16 µs with one). So a waiting rank first tries the
semaphore for up to ``SPIN_US`` (``DPLAB_SPIN_US``), which catches a peer a few microseconds
behind, and only then sleeps. The spin is bounded and adapts: a wait that ends asleep anyway
(a long message, or a machine so busy that the peer has no core) halves the next spin, down to
a sixteenth; every eighth wait spins in full, and one that succeeds restores it. Spinning
only pays while every rank has a core of its own: when ranks outnumber cores (world size 4 or
8 on two cores) a spinning rank takes the core from the very peer it waits for, so there it
sleeps at once (``DPLAB_YIELDS`` > 0 gives the core away with ``sched_yield`` that many times
first: measured 1.5x slower at p=4 on an idle machine, so off by default).

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

__all__ = ["Waits", "wait_policy", "SPIN_US", "PEEK_S"]

SPIN_US = 20  # how long a wait spins at most before it sleeps, when every rank has a core
PEEK_S = (1e-3, 0.25)  # a sender waiting this long looks at the peer's own message, then doubles
_TAG = struct.Struct("q")  # the last of a descriptor's five int64 (comm.py's _DESC)


def wait_policy(world_size: int) -> tuple[float, int]:
    """(seconds of spin, yields) before a wait sleeps: spin with a core per rank, else neither."""
    own_core = world_size <= len(os.sched_getaffinity(0))
    spin = float(os.environ.get("DPLAB_SPIN_US", SPIN_US)) * 1e-6 if own_core else 0.0
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
        if self._spin:
            self._waits += 1  # every 8th wait spins in full: is the peer quick again?
            budget, clock = self._spin if self._waits % 8 == 0 else self._budget, time.perf_counter
            end = clock() + budget
            while clock() < end:
                for _ in range(8):  # a try costs ~60 ns, a clock read as much
                    if sem.acquire(False):
                        self._budget = self._spin
                        return
            self._budget = max(budget / 2, self._spin / 16)  # the peer is slow, or has no core: back off
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
