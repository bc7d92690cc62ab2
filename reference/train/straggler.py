"""Time as an experimental variable: slowed ranks (stragglers) and wall-time budgets.

A STRAGGLER of FACTOR sleeps (FACTOR - 1) x each piece of compute it measured (the forward, each
layer of the backward), kept as a running balance, so its buckets still leave as completed;
communication is not slowed, and each sleep is a ``slowdown`` trace event. ``delays`` are fixed
seconds a rank sleeps before each (micro-)batch, for deterministic tests. A BUDGET stops after a
wall time: one rank decides (rank 0 in sync, the server in async) and tells the others, so all
stop at the same step. Stragglers change when, not what: a sync run stays within rounding of
one device, and an async run still replays from its log.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from dplab.reference.errors import ConfigError
from dplab.reference.trace import Tracer
from dplab.reference.train.hooks import Hook

__all__ = ["Stragglers", "parse_stragglers", "check_stragglers", "factor_of", "check_delays",
           "Slowdown", "Straggle", "Budget", "TimeBudget", "check_budget"]

Stragglers = tuple[tuple[int, float], ...]  # ((rank, factor), ...): each slowed rank once
T = TypeVar("T")
_END = object()


def parse_stragglers(text: str) -> Stragglers:
    """``"1:4"`` or ``"1:4,2:1.5"`` -> ``((1, 4.0), (2, 1.5))``;
    ConfigError saying the form otherwise.

    Args:
        text: RANK:FACTOR pairs, comma-separated.

    Returns:
        ((rank, factor), ...).

    Raises:
        ConfigError: an item that is not RANK:FACTOR.
    """
    pairs = []
    for item in (s.strip() for s in text.split(",")):
        rank, sep, factor = item.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(rank), float(factor)))
        except ValueError:
            raise ConfigError(f"bad straggler {item!r}: write RANK:FACTOR, e.g. 1:4 "
                              "(rank 1 computes 4 times slower)") from None
    return tuple(pairs)


def check_stragglers(stragglers: Stragglers, world_size: int | None = None, first: int = 0) -> None:
    """ConfigError unless each straggler names a computing rank (``first``..world_size-1) once,
    factor>=1.

    Args:
        stragglers: ((rank, factor), ...).
        world_size: the number of ranks, if known.
        first: the lowest rank that computes (1 under a parameter server).

    Raises:
        ConfigError: a rank out of range or named twice, or a factor that is not finite and >= 1.
    """
    ranks = [r for r, _ in stragglers]
    for rank, factor in stragglers:
        if not (isinstance(rank, int) and rank >= first):
            hint = " (rank 0 is the parameter server: it computes no gradients)" if first else ""
            raise ConfigError(f"straggler rank must be an integer >= {first}{hint}, got {rank!r}")
        if world_size is not None and rank >= world_size:
            raise ConfigError(f"straggler rank {rank} is out of range: world_size {world_size} has "
                              f"ranks 0..{world_size - 1}")
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
            raise ConfigError(f"straggler factor must be a finite number >= 1 (1 = full speed), "
                              f"got {factor!r} for rank {rank}")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"each straggler rank may appear once, got ranks {ranks}")


def check_delays(delays: tuple[float, ...] | None, count: int | None, per: str) -> None:
    """ConfigError unless ``delays`` is None or holds ``count`` finite seconds >= 0, one per
    ``per``.

    Args:
        delays: seconds, or None.
        count: how many there must be, if known.
        per: what each is for ("rank", "worker"), for the message.

    Raises:
        ConfigError: a delay that is not finite and >= 0, or the wrong number of them.
    """
    if delays is None:
        return
    if not all(isinstance(d, (int, float)) and math.isfinite(d) and d >= 0 for d in delays):
        raise ConfigError(f"delays must be finite seconds >= 0, got {delays}")
    if count is not None and len(delays) != count:
        raise ConfigError(f"delays needs one entry per {per} ({count}), got {len(delays)}")


def factor_of(stragglers: Stragglers, rank: int) -> float:
    """How many times slower ``rank`` computes: its factor, or 1.

    Args:
        stragglers: ((rank, factor), ...).
        rank: the rank.

    Returns:
        The factor (1.0 for a rank at full speed).
    """
    return dict(stragglers).get(rank, 1.0)


class Slowdown:
    """Stretches one rank's compute by ``factor``: sleeps (factor - 1) x each piece's measured
    time.

    Args:
        factor: how many times slower (1: full speed).
        tracer: where each sleep is recorded as a "slowdown" span, or None.
    """

    def __init__(self, factor: float = 1.0, tracer: Tracer | None = None) -> None:
        self.factor, self.tracer = float(factor), tracer  # each sleep is a "slowdown" span
        self.compute_s = 0.0  # measured compute, in total
        self.owed_s = 0.0  # sleep still owed; negative after an overshoot (a credit)
        self.slept_s = 0.0  # so slept_s + owed_s == (factor - 1) * compute_s, always

    @classmethod
    def for_rank(cls, stragglers: Stragglers, rank: int, tracer: Tracer | None = None) -> Slowdown:
        """The slowdown of ``rank`` among ``stragglers`` (factor 1: none).

        Args:
            stragglers: ((rank, factor), ...).
            rank: this rank.
            tracer: where each sleep is recorded as a "slowdown" span, or None.

        Returns:
            The slowdown.
        """
        return cls(factor_of(stragglers, rank), tracer)

    @contextmanager
    def compute(self, delay_s: float = 0.0) -> Iterator[None]:
        """Around one piece of compute: a fixed ``delay_s`` first, afterwards the slowdown it
        earned.

        Args:
            delay_s: seconds to sleep first.
        """
        if delay_s > 0:  # even sleep(0) gives the core away: on a busy machine that takes a while
            time.sleep(delay_s)
        t0 = time.perf_counter()
        yield
        self._pay(time.perf_counter() - t0)

    def pieces(self, steps: Iterable[T]) -> Iterator[T]:
        """Each step of a compute generator (the backward's layers), stretched before it is handed
        on.

        Args:
            steps: the generator's items.

        Yields:
            Each item, once the time it took has been stretched.
        """
        it = iter(steps)
        while True:
            t0 = time.perf_counter()
            item = next(it, _END)
            self._pay(time.perf_counter() - t0)
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def _pay(self, compute_s: float) -> None:
        """Sleep off what ``compute_s`` of compute earned, net of any earlier overshoot."""
        if self.factor == 1.0:
            return
        self.compute_s += compute_s
        self.owed_s += (self.factor - 1) * compute_s
        if self.owed_s > 0:
            t0 = time.perf_counter_ns()
            time.sleep(self.owed_s)
            t1 = time.perf_counter_ns()
            self.owed_s -= (t1 - t0) / 1e9
            self.slept_s += (t1 - t0) / 1e9
            if self.tracer is not None:
                offset = self.tracer.offset_ns
                self.tracer.record("slowdown", t0 + offset, t1 + offset, extra={
                    "factor": self.factor, "compute_s": self.compute_s, "slept_s": self.slept_s})


class Straggle(Hook):
    """A slowed rank in ``train_sync``: a fixed ``delay_s`` before each micro-batch, then its
    forward and each backward layer stretched by ``slow``'s factor, so its buckets leave as late as
    they would.

    Args:
        slow: the slowdown.
        delay_s: seconds slept before each micro-batch.
    """

    def __init__(self, slow: Slowdown, delay_s: float = 0.0) -> None:
        self.slow, self.delay_s = slow, delay_s

    def forward(self, step: int, micro: int) -> AbstractContextManager[Any]:
        return self.slow.compute(self.delay_s)

    def backward(self, step: int, micro: int, layers: Iterator[int]) -> Iterator[int]:
        return self.slow.pieces(layers)


class Budget:
    """Wall time allowed from construction; ``None`` seconds never runs out.

    Args:
        seconds: the time allowed, or None for no limit.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def spent(self) -> bool:
        """Whether the time allowed has run out.

        Returns:
            True once ``seconds`` have passed since construction (never with None).
        """
        return self.seconds is not None and time.perf_counter() - self.start >= self.seconds


class TimeBudget(Hook):
    """Rank 0's wall-time budget in ``train_sync``: once spent, it asks every rank to stop after the
    step (at least one step is taken; ``TrainConfig.steps`` stays the upper bound).

    Args:
        seconds: the time allowed, counted from now.
    """

    def __init__(self, seconds: float) -> None:
        self.budget = Budget(seconds)  # the clock starts now: set-up counts too

    def wants_to_stop(self, step: int) -> bool:
        return self.budget.spent()


def check_budget(seconds: float | None) -> None:
    """Refuse a time budget that is not finite seconds >= 0.

    Args:
        seconds: the budget, or None for none.

    Raises:
        ConfigError: saying what it must be.
    """
    if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds)
                                    and seconds >= 0):
        raise ConfigError("time_budget_s must be finite seconds >= 0 (or None: no budget), got "
                          f"{seconds!r}")
