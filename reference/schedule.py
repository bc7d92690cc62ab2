"""Collectives as data: a Schedule is chunks plus rounds of Transfers.

An algorithm is a pure function ``world_size -> Schedule``. The same object is run
by the executor (``dplab.reference.collectives``) on every backend, checked by the
simulator (``dplab.reference.simulate``), priced by the cost model
(``dplab.reference.costmodel``) and drawn by the visualizer. One source of truth.

The flat buffer of n elements is cut into ``num_chunks`` contiguous chunks
(``chunk_bounds``). A round is a set of transfers that may all happen at once;
``Transfer(src, dst, chunk, op)`` means "src sends its chunk to dst, which adds it
to its own (op='reduce') or overwrites its own (op='copy')". A send carries the
value the chunk had at the start of the round.

    >>> from dplab.reference.algorithms import allreduce_schedule
    >>> s = allreduce_schedule("ring", 3)
    >>> len(s.rounds), s.num_chunks
    (4, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dplab.reference.errors import DplabError

__all__ = ["Op", "Transfer", "Schedule", "chunk_bounds", "concat", "ScheduleError"]

Op = Literal["reduce", "copy"]


class ScheduleError(DplabError, ValueError):
    """A schedule that cannot be executed as written."""


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    chunk: int
    op: Op


@dataclass(frozen=True)
class Schedule:
    """``rounds[k]`` lists the transfers of round k; all of them may run concurrently."""

    name: str
    world_size: int
    num_chunks: int
    rounds: tuple[tuple[Transfer, ...], ...]

    def __post_init__(self) -> None:
        validate(self)

    def transfers_of(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """Per round, the (sends, receives) that ``rank`` takes part in, in schedule order."""
        return [
            ([t for t in rnd if t.src == rank], [t for t in rnd if t.dst == rank])
            for rnd in self.rounds
        ]


def validate(s: Schedule) -> None:
    p, k = s.world_size, s.num_chunks
    if p < 1 or k < 1:
        raise ScheduleError(f"{s.name}: world_size and num_chunks must be >= 1, got {p}, {k}")
    for i, rnd in enumerate(s.rounds):
        touched_by_recv: set[tuple[int, int]] = set()
        for t in rnd:
            if not (0 <= t.src < p and 0 <= t.dst < p and 0 <= t.chunk < k):
                raise ScheduleError(f"{s.name} round {i}: {t} is out of range (p={p}, k={k})")
            if t.src == t.dst:
                raise ScheduleError(f"{s.name} round {i}: {t} sends to itself")
            if t.op not in ("reduce", "copy"):
                raise ScheduleError(f"{s.name} round {i}: unknown op {t.op!r}")
            touched_by_recv.add((t.dst, t.chunk))
        # A rank must not send a chunk it is also receiving into in the same round:
        # with zero-copy transports the peer would read a half-updated chunk.
        for t in rnd:
            if (t.src, t.chunk) in touched_by_recv:
                raise ScheduleError(
                    f"{s.name} round {i}: rank {t.src} sends chunk {t.chunk} while receiving into it"
                )


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """Split range(n) into k contiguous pieces; the first ``n % k`` get one extra element.

    Works for any n >= 0 including n < k (trailing pieces are empty). The same rule
    shards a global batch over ranks.

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if n < 0 or k < 1:
        raise ValueError(f"chunk_bounds needs n >= 0 and k >= 1, got n={n}, k={k}")
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def concat(name: str, *parts: Schedule) -> Schedule:
    """Run schedules one after another over the same chunking (e.g. reduce-scatter + all-gather)."""
    p, k = parts[0].world_size, parts[0].num_chunks
    if any(s.world_size != p or s.num_chunks != k for s in parts):
        raise ScheduleError(f"{name}: parts disagree on world_size or num_chunks")
    return Schedule(name, p, k, tuple(rnd for s in parts for rnd in s.rounds))
