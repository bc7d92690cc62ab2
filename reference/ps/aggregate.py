"""Per-clock aggregation and backup workers: one update from the first W - b gradients of a clock.

With ``aggregate=True`` the server does not apply gradients as they come: it holds a
clock's gradients until W - b of them are there (b = ``backup_workers``; b = 0: all W,
which is synchronous training), then hands them over in WORKER order, so the sum is the
same bits whatever order they arrived in. A gradient of a clock that is already applied
came too late: it is dropped (and the server's log never mentions it).

    >>> agg = Aggregator(workers=3, backup_workers=1)
    >>> agg.hold(2, 0, g2) is None, [w for w, _ in agg.hold(3, 0, g3)]      # doctest: +SKIP
    (True, [2, 3])
    >>> agg.late(0, version=1)       # worker 1's clock 0 arrives after the update  # doctest: +SKIP
    True
"""

from __future__ import annotations

import numpy as np

__all__ = ["Aggregator"]


class Aggregator:
    """The gradients held per clock until enough have come, and the pushes dropped as too late.

    Args:
        workers: the number of workers.
        backup_workers: how many of each clock's gradients may be missing.
    """

    def __init__(self, workers: int, backup_workers: int = 0) -> None:
        self.needed = workers - backup_workers  # gradients that make one update
        self.held: dict[int, dict[int, np.ndarray]] = {}  # clock -> worker -> gradient (a copy)
        self.dropped: list[tuple[int, int]] = []  # (worker, clock) that arrived after their update

    def late(self, clock: int, version: int) -> bool:
        """Was ``clock``'s update already applied (version counts the updates so far)?

        Args:
            clock: the push's clock.
            version: the updates applied so far.

        Returns:
            True if the push came too late to count.
        """
        return clock < version

    def drop(self, worker: int, clock: int) -> None:
        """Record a gradient that came too late: it is logged as dropped, never applied.

        Args:
            worker: the worker that pushed it.
            clock: its clock.
        """
        self.dropped.append((worker, clock))

    def hold(
        self, worker: int, clock: int, grad: np.ndarray
    ) -> list[tuple[int, np.ndarray]] | None:
        """Keep a copy of ``grad``; once ``needed`` have come:
        (worker, gradient) in worker order.

        Args:
            worker: the worker that pushed it.
            clock: its clock.
            grad: the gradient (copied).

        Returns:
            The clock's gradients once ``needed`` have come, else None.
        """
        held = self.held.setdefault(clock, {})
        held[worker] = grad.copy()
        if len(held) < self.needed:
            return None
        return sorted(self.held.pop(clock).items())  # worker order: a fixed sum
