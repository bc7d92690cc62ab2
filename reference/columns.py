"""A schedule as columns of small integers: what the cost model prices, up to p = 4096.

The ring at p = 4096 has 2 (p - 1) rounds of p transfers: 33.5 million. As ``Transfer`` objects
that is minutes and gigabytes; as four columns (src, dst, chunk, reduce) it is about 235 MB, and
the cost model (``dplab.reference.costmodel``) prices it with vectorised numpy, a block of rounds
at a time. ``columns(schedule)`` makes the columns of a readable ``Schedule`` (once per schedule);
at large p the engine builds them directly, a ``Round`` of arrays per round
(``dplab.backends.fastpath.arrays``, held equal to the readable builders row for row):

    columns(ring.allreduce(8))                      # from the readable schedule
    r = np.arange(p)                                # the ring's reduce-scatter as arrays
    RoundTable.build("ring_reduce_scatter", p, p, [Round(r, (r + 1) % p, (r - k - 1) % p, "reduce")
                                                   for k in range(p - 1)])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dplab.reference.schedule import Schedule, ScheduleError, Transfer

__all__ = ["Round", "RoundTable", "columns"]


class Round:
    """One round as arrays: transfer i is ``src[i] -> dst[i]`` of ``chunk[i]``, reduced or copied.

    Scalars broadcast (``Round(r, (r + 1) % p, 0, "copy")``); ``op`` is "reduce", "copy" or an
    array of them. Order is kept: it is the order the executor posts a rank's messages in.

    Args:
        src: sending ranks (an array, or one rank for all).
        dst: receiving ranks.
        chunk: chunk indices.
        op: "reduce", "copy", or an array of them.

    Raises:
        ScheduleError: an unknown op.
        ValueError: columns that do not broadcast together (numpy's).
    """

    __slots__ = ("src", "dst", "chunk", "reduce")

    def __init__(self, src: Any, dst: Any, chunk: Any, op: Any) -> None:
        ops = np.ravel(np.asarray(op))  # one op per transfer, or one for all
        is_reduce = ops == "reduce"
        bad = ops[~is_reduce & (ops != "copy")]
        if bad.size:
            raise ScheduleError(f"unknown op {str(bad[0])!r}: a transfer either 'reduce's or "
                                "'copy's")
        # (no np.unique: it imports numpy.ma)
        mixed = bool(is_reduce.any()) and not bool(is_reduce.all())
        reduce = np.asarray(op) == "reduce" if mixed else bool(is_reduce.size and is_reduce[0])
        cols = [np.ravel(np.asarray(a)) for a in (src, dst, chunk)]
        cols = [a if a.dtype.kind in "iu" else a.astype(np.int64) for a in cols]
        if len({a.size for a in cols}) > 1 or np.ndim(reduce):
            cols = [np.ravel(a) for a in np.broadcast_arrays(*cols, np.asarray(reduce))][:3]
        self.src, self.dst, self.chunk = cols
        self.reduce = np.ravel(np.broadcast_to(np.asarray(reduce, dtype=bool), cols[0].shape))

    @classmethod
    def of(cls, transfers: Iterable[Any], index: int = 0) -> Round:
        """A tuple of ``Transfer`` as a Round (``index``: the round's number, for the error).

        Args:
            transfers: the round's transfers.
            index: the round's number.

        Returns:
            The round as columns.

        Raises:
            ScheduleError: an unknown op.
        """
        ts = tuple(transfers)
        for t in ts:
            if t.op not in ("reduce", "copy"):
                raise ScheduleError(f"round {index}: unknown op {t.op!r} in {t}")
        src, dst, chunk = (
            np.array([getattr(t, f) for t in ts], np.int64) for f in ("src", "dst", "chunk")
        )
        return cls(
            src,
            dst,
            chunk,
            np.array([t.op for t in ts], dtype=object).astype(str) if ts else "copy",
        )


def columns(schedule: Schedule | RoundTable) -> RoundTable:
    """The schedule's columns (made once per schedule, then kept); a RoundTable is its own.

    Args:
        schedule: a schedule, or a table.

    Returns:
        The table.
    """
    if isinstance(schedule, RoundTable):
        return schedule
    s = schedule
    return s.memo("columns", lambda: RoundTable.build(s.name, s.world_size, s.num_chunks, s.rounds))


@dataclass(frozen=True, eq=False)
class RoundTable:
    """A schedule's rounds one after another; round i is rows ``starts[i]:starts[i + 1]``.

    Columns are int16 when the world and the chunk count fit (p, k < 32768), else int32. Built from
    ``Round`` arrays it is range-checked only: the engine's builders are held equal to the readable
    ones, which ``Schedule`` checks in full.

    Args:
        name: the schedule's name.
        world_size: the number of ranks.
        num_chunks: the number of chunks.
        src: sending rank per row.
        dst: receiving rank per row.
        chunk: chunk per row.
        reduce: per row, True for a reduce, False for a copy.
        starts: where each round's rows begin, and the end.
    """

    name: str
    world_size: int
    num_chunks: int
    src: np.ndarray
    dst: np.ndarray
    chunk: np.ndarray
    reduce: np.ndarray  # bool: True for op 'reduce', False for 'copy'
    starts: np.ndarray  # int64, len(rounds) + 1
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    @staticmethod
    def build(name: str, world_size: int, num_chunks: int, rounds: Iterable[Any]) -> RoundTable:
        """From Rounds or tuples of Transfers (mixed is fine); the rows are range-checked here.

        Args:
            name: the schedule's name.
            world_size: the number of ranks.
            num_chunks: the number of chunks.
            rounds: the rounds.

        Returns:
            The table.

        Raises:
            ScheduleError: world_size or num_chunks < 1, or a rank or chunk out of range.
        """
        if world_size < 1 or num_chunks < 1:
            raise ScheduleError(f"{name}: world_size and num_chunks must be >= 1, got "
                                f"{world_size}, {num_chunks}")
        dtype = np.int16 if max(world_size, num_chunks) < 2**15 else np.int32
        cols: list[list[np.ndarray]] = [[], [], [], []]
        counts = [0]
        for i, rnd in enumerate(rounds):
            r = rnd if isinstance(rnd, Round) else Round.of(rnd, i)
            for a, limit in ((r.src, world_size), (r.dst, world_size), (r.chunk, num_chunks)):
                if a.size and (a.min() < 0 or a.max() >= limit):
                    out = ((r.src < 0) | (r.src >= world_size) | (r.dst < 0) | (r.dst >= world_size)
                           | (r.chunk < 0) | (r.chunk >= num_chunks))
                    j = int(np.flatnonzero(out)[0])
                    bad = _transfer(r.src[j], r.dst[j], r.chunk[j], r.reduce[j])
                    raise ScheduleError(f"{name} round {i}: {bad} is out of range "
                                        f"(p={world_size}, k={num_chunks})")
            for col, a in zip(cols, (r.src, r.dst, r.chunk)):
                col.append(a.astype(dtype))
            cols[3].append(r.reduce)
            counts.append(len(r.reduce))
        src, dst, chunk = (np.concatenate(c) if c else np.zeros(0, dtype) for c in cols[:3])
        reduce = np.concatenate(cols[3]) if cols[3] else np.zeros(0, bool)
        starts = np.cumsum(counts, dtype=np.int64)
        return RoundTable(name, world_size, num_chunks, src, dst, chunk, reduce, starts)

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def num_transfers(self) -> int:
        return int(self.starts[-1])

    def round_ids(self, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """The round of every row of rounds r0..r1-1, numbered from 0 at r0.

        Args:
            r0: the first round.
            r1: one past the last (default: the end).

        Returns:
            One round number per row.
        """
        r1 = len(self) if r1 is None else r1
        return np.repeat(np.arange(r1 - r0, dtype=np.int64), np.diff(self.starts[r0:r1 + 1]))

    def transfers(self, i: int) -> tuple[Transfer, ...]:
        """Round ``i`` as ``Transfer`` objects (the readable schedule's form).

        Args:
            i: the round.

        Returns:
            Its transfers, in row order.
        """
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return tuple(
            _transfer(*row)
            for row in zip(
                self.src[a:b].tolist(),
                self.dst[a:b].tolist(),
                self.chunk[a:b].tolist(),
                self.reduce[a:b].tolist(),
            )
        )

    def blocks(
        self, max_rows: int = 1 << 20, max_rounds: int | None = None
    ) -> Iterator[tuple[int, int]]:
        """Consecutive round ranges [r0, r1) of at most ``max_rows`` rows (a bigger round alone).

        Args:
            max_rows: the most rows a block holds.
            max_rounds: the most rounds a block holds, or None.

        Yields:
            (r0, r1) for each block, in order.
        """
        r0, n = 0, len(self)
        while r0 < n:
            r1 = int(np.searchsorted(self.starts, self.starts[r0] + max_rows, side="right")) - 1
            r1 = max(r1, r0 + 1) if max_rounds is None else max(min(r1, r0 + max_rounds), r0 + 1)
            yield r0, min(r1, n)
            r0 = min(r1, n)

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per table and key (the cost model keeps its summaries here).

        Args:
            key: what the value is of.
            compute: makes the value the first time.

        Returns:
            The value kept for ``key``.
        """
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def equals(self, other: RoundTable) -> bool:
        """Whether two tables hold the same schedule, row for row.

        Args:
            other: the other table.

        Returns:
            True if the names, sizes and every column are equal.
        """
        sizes = lambda t: (t.name, t.world_size, t.num_chunks)  # noqa: E731
        return sizes(self) == sizes(other) and all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("starts", "src", "dst", "chunk", "reduce")
        )

    @staticmethod
    def concat(name: str, *parts: RoundTable) -> RoundTable:
        """``schedule.concat`` for tables: one after another over the same chunking.

        Args:
            name: the new table's name.
            *parts: the tables, in the order they run.

        Returns:
            One table with all their rounds.

        Raises:
            ScheduleError: the parts differ in world_size or num_chunks.
        """
        p, k = parts[0].world_size, parts[0].num_chunks
        if any(t.world_size != p or t.num_chunks != k for t in parts):
            raise ScheduleError(f"{name}: parts disagree on world_size or num_chunks")
        offsets = np.cumsum([0] + [t.num_transfers for t in parts])
        starts = np.concatenate(
            [np.zeros(1, np.int64)] + [t.starts[1:] + o for t, o in zip(parts, offsets)]
        )
        return RoundTable(name, p, k, *(np.concatenate([getattr(t, f) for t in parts])
                                        for f in ("src", "dst", "chunk", "reduce")), starts)


def _transfer(src: Any, dst: Any, chunk: Any, reduce: Any) -> Transfer:
    return Transfer(int(src), int(dst), int(chunk), "reduce" if reduce else "copy")
