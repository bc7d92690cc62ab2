"""How a rank of the local backend waits: spin, then sleep, never past its timeout.

A semaphore post that finds its waiter asleep costs a futex wake-up, and the waiter tens of
microseconds to be scheduled again: more than a whole round of a small all-reduce. So a waiting
rank first tries the semaphore for up to ``SPIN_US`` (``DPLAB_SPIN_US``), which catches a peer a
few microseconds behind, and only then sleeps. The spin is bounded and adapts: a wait that ends
asleep anyway (a long message, or a machine so busy that the peer has no core) halves the next
spin, down to a sixteenth; every eighth wait spins in full, and one that succeeds restores it.
Spinning only pays while every rank has a core of its own: when ranks outnumber cores a spinning
rank takes the core from the very peer it waits for, so there it sleeps at once
(``DPLAB_YIELDS`` > 0 gives the core away with ``sched_yield`` that many times first).

A wait given a ``peek`` sleeps in doubling slices and calls it in between: that is how a sender
waiting for a collective's peer notices that the peer is in another collective (``mailboxes.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from dplab.reference.communicator import CommTimeout

__all__ = ["Waiter", "wait_policy", "SPIN_US", "PEEK_S"]

SPIN_US = 20  # how long a wait spins at most before it sleeps, when every rank has a core
PEEK_S = (1e-3, 0.25)  # a waiter with a peek sleeps this long first, then doubles up to the second


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

    def acquire(self, sem: Any, what: str, peer: int, peek: Callable[[], None] | None = None) -> None:
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
