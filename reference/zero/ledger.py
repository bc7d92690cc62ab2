"""A memory ledger: the bytes a rank holds for parameters, gradients and optimizer state.

    ledger = MemoryLedger()
    w = ledger.zeros("params", n, np.float64)      # allocate through the ledger ...
    ledger.free(w); del w                          # ... and tell it when the array goes
    opt = ledger.track("optimizer", lambda: make_optimizer(cfg, n))   # arrays made elsewhere
    ledger.report().params                         # the peak of "params" since reset_peaks()

Closed forms say what ZeRO *should* save; the ledger says what the trainer *did* hold. Every
array of model state the ZeRO trainer keeps goes through ``zeros`` or ``track`` and is counted
with its real ``nbytes``; ``free`` takes it off. The ledger keeps the current bytes per
category and their peaks (per category, and of the sum). A ledger can lie (a "freed" array
still referenced somewhere is still memory), so the tests hold it against ``tracemalloc``,
which NumPy tells about every buffer it allocates: at every allocation the bytes tracemalloc
traces to this file must equal the ledger's current total (``on_alloc`` is their hook).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError

__all__ = ["CATEGORIES", "MemoryLedger", "MemoryReport"]

CATEGORIES = ("params", "grads", "optimizer")
T = TypeVar("T")


@dataclass(frozen=True)
class MemoryReport:
    """Peak bytes per category (the names of ``zero.memory.MemoryBreakdown``), and of their sum.

    ``total`` is the peak of the SUM at one moment, which can be less than the sum of the three
    peaks (stage 3's gathered weights and in-flight gradients peak at different times).

    Args:
        params: peak bytes of weights.
        grads: peak bytes of gradients.
        optimizer: peak bytes of optimizer state.
        total: peak bytes of all three at one moment.
    """

    params: int
    grads: int
    optimizer: int
    total: int


class MemoryLedger:
    """Current and peak bytes of model state, per category. Used by one thread (the main one)."""

    def __init__(self) -> None:
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self._held: dict[int, tuple[str, int]] = {}  # id(array) -> (category, nbytes)
        # tests: compare with tracemalloc
        self.on_alloc: Callable[[MemoryLedger], None] | None = None

    def zeros(self, category: str, n: int, dtype: DTypeLike) -> np.ndarray:
        """A new zeroed 1-D array of ``n`` elements, counted under ``category``.

        Args:
            category: "params", "grads" or "optimizer".
            n: the number of elements.
            dtype: the dtype.

        Returns:
            The array.
        """
        arr = np.zeros(n, dtype=dtype)
        self._add(category, [arr])
        return arr

    def empty(self, category: str, n: int, dtype: DTypeLike) -> np.ndarray:
        """Like ``zeros``, for a buffer the caller fills at once (a gather's destination).

        Args:
            category: "params", "grads" or "optimizer".
            n: the number of elements.
            dtype: the dtype.

        Returns:
            The array, uninitialised.
        """
        arr = np.empty(n, dtype=dtype)
        self._add(category, [arr])
        return arr

    def track(self, category: str, build: Callable[[], T]) -> T:
        """Call ``build()`` (which allocates, e.g. an optimizer) and count every array attribute
        of what it returns; those arrays are held until the end (no ``free``).

        Args:
            category: the category to count the arrays under.
            build: makes the object.

        Returns:
            What ``build()`` returned.
        """
        obj = build()
        self._add(category, [v for v in vars(obj).values() if isinstance(v, np.ndarray)])
        return obj

    def free(self, arr: np.ndarray) -> None:
        """``arr`` is no longer held: drop every reference to it, or the ledger lies.

        Args:
            arr: an array this ledger counted.

        Raises:
            ConfigError: the ledger does not hold ``arr``.
        """
        if id(arr) not in self._held:
            raise ConfigError("freeing an array the ledger does not hold: allocate it with "
                              "ledger.zeros")
        category, nbytes = self._held.pop(id(arr))
        self.current[category] -= nbytes

    def reset_peaks(self) -> None:
        """Peaks from now on (the trainer calls it before its first step: set-up is not a step)."""
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())

    def report(self) -> MemoryReport:
        """The peaks so far.

        Returns:
            Peak bytes of params, grads, optimizer state, and of all three at once.
        """
        return MemoryReport(
            self.peak["params"], self.peak["grads"], self.peak["optimizer"], self.peak_total
        )

    def _add(self, category: str, arrays: list[Any]) -> None:
        if category not in CATEGORIES:
            raise ConfigError(f"category must be one of {', '.join(CATEGORIES)}, got {category!r}")
        for arr in arrays:
            self._held[id(arr)] = (category, arr.nbytes)
            self.current[category] += arr.nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))
        if self.on_alloc is not None:
            self.on_alloc(self)
