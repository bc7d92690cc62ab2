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

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from dplab.reference.rounds import Op, Round, RoundTable, ScheduleError, Transfer, _transfer

__all__ = ["Op", "Transfer", "Round", "Schedule", "chunk_bounds", "concat", "ScheduleError", "Message",
           "messages", "messages_of"]


class Schedule:
    """``rounds[k]`` lists the transfers of round k; all of them may run concurrently.

    ``Schedule(name, world_size, num_chunks, rounds)`` takes rounds as tuples of ``Transfer`` or as
    ``Round`` arrays. It keeps them once, as columns (``table``: ``dplab.reference.rounds``), and
    builds the ``Transfer`` tuples of ``rounds`` from them the first time they are read. Immutable."""

    __slots__ = ("name", "world_size", "num_chunks", "table", "_rounds", "_memo")

    def __init__(self, name: str, world_size: int, num_chunks: int, rounds: Iterable[Any] | RoundTable,
                 _checked: bool = False) -> None:
        put = object.__setattr__
        put(self, "name", name)
        put(self, "world_size", int(world_size))
        put(self, "num_chunks", int(num_chunks))
        try:
            put(self, "table", RoundTable.build(rounds, max(world_size, 0), max(num_chunks, 0)))
        except ScheduleError as e:
            raise ScheduleError(f"{name} {e}") from None
        put(self, "_rounds", None)
        put(self, "_memo", {})
        if not _checked:
            validate(self)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Schedule is immutable: cannot set {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its columns (``st.cache_data`` and persistent worlds pickle schedules)."""
        return (Schedule, (self.name, self.world_size, self.num_chunks, self.table, True))

    @property
    def rounds(self) -> tuple[tuple[Transfer, ...], ...]:
        if self._rounds is None:
            object.__setattr__(self, "_rounds", tuple(map(self.table.transfers, range(len(self.table)))))
        return self._rounds

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        key = lambda s: (s.name, s.world_size, s.num_chunks)  # noqa: E731
        return key(self) == key(other) and self.table.equals(other.table)

    def __hash__(self) -> int:
        return hash((self.name, self.world_size, self.num_chunks, len(self.table), self.table.num_transfers))

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, world_size={self.world_size}, num_chunks={self.num_chunks}, "
                f"{len(self.table)} rounds, {self.table.num_transfers} transfers)")

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per schedule and key (the cost model keeps its summaries here)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def transfers_of(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """Per round, the (sends, receives) that ``rank`` takes part in, in schedule order."""
        t = self.table
        rows = np.flatnonzero((t.src == rank) | (t.dst == rank))
        out: list[tuple[list[Transfer], list[Transfer]]] = [([], []) for _ in range(len(t))]
        for row, i in zip(rows.tolist(), (np.searchsorted(t.starts, rows, side="right") - 1).tolist()):
            tr = _transfer(t.src[row], t.dst[row], t.chunk[row], t.reduce[row])
            out[i][tr.src != rank].append(tr)
        return out


def validate(s: Schedule) -> None:
    """Refuse what cannot run as written. Rows out of range and unknown ops are refused while the
    table is built (``RoundTable.build``); the rest is checked here, on the columns, per block."""
    p, k, t = s.world_size, s.num_chunks, s.table
    if p < 1 or k < 1:
        raise ScheduleError(f"{s.name}: world_size and num_chunks must be >= 1, got {p}, {k}")
    selfs = np.flatnonzero(t.src == t.dst)
    if selfs.size:
        row = int(selfs[0])
        bad = _transfer(t.src[row], t.dst[row], t.chunk[row], t.reduce[row])
        raise ScheduleError(f"{s.name} round {_round_of(t, row)}: {bad} sends to itself")
    # A rank may send a chunk it also receives into (recursive doubling's exchange): the send
    # carries the chunk as the round found it (the executor sends a snapshot, messages_of).
    # But a copy overwrites: two receives into one chunk in one round, one of them a copy,
    # would depend on the order they land in.
    for r0, r1 in t.blocks(max_rows=1 << 20, max_rounds=max(1, (1 << 22) // p)):
        a, b = int(t.starts[r0]), int(t.starts[r1])
        if t.reduce[a:b].all():
            continue  # only a copy can land in a chunk ambiguously
        rid = t.round_ids(r0, r1)
        if np.bincount(rid * p + t.dst[a:b], minlength=1).max() <= 1:
            continue  # no rank receives twice in one round of this block
        if (r1 - r0) * k <= 1 << 24 and np.bincount(rid * k + t.chunk[a:b], minlength=1).max() <= 1:
            continue  # no chunk moves twice in one round (the pipelined ring's slices): cheap, no isin
        key, copy = (rid * p + t.dst[a:b]) * k + t.chunk[a:b], ~t.reduce[a:b]
        space = (r1 - r0) * p * k
        if space <= 4 * (b - a):  # dense: the keys (round, rank, chunk) that break the rule, by counting
            twice = np.bincount(key, minlength=space)[key] > 1
            rows = np.flatnonzero(twice & (np.bincount(key[copy], minlength=space)[key] > 0))
        else:
            rows = np.flatnonzero(np.isin(key, key[copy]))
        if not rows.size:
            continue
        order = np.argsort(key[rows], kind="stable")
        ks = key[rows][order]
        bad = rows[order[np.r_[False, ks[1:] == ks[:-1]]]]  # a later receive into a chunk received into
        if bad.size:
            row = a + int(bad.min())
            raise ScheduleError(f"{s.name} round {_round_of(t, row)}: rank {int(t.dst[row])} receives chunk "
                                f"{int(t.chunk[row])} twice, once as a copy: which lands last is undefined")


def _round_of(t: RoundTable, row: int) -> int:
    return int(np.searchsorted(t.starts, row, side="right") - 1)


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
    # every rule is per round, so parts that passed make a whole that passes: no second check
    return Schedule(name, p, k, RoundTable.concat(s.table for s in parts), _checked=True)


class Message(NamedTuple):
    """What travels: a round's transfers from ``src`` to ``dst`` with one op and consecutive chunks
    go as one message, chunks ``chunk .. stop - 1`` (Rabenseifner's half-buffers: one message, one
    alpha). ``snapshot``: the sender also receives into one of these chunks in the same round, so
    the executor sends a copy taken at the start of the round (what the schedule's send means)."""

    src: int
    dst: int
    chunk: int
    op: Op
    stop: int
    snapshot: bool = False


def messages(transfers: Iterable[Transfer]) -> list[Message]:
    """Coalesce transfers (of one round) into messages: per (src, dst, op), in order of first
    appearance, each run of consecutive chunks. Sender and receiver see the same transfers
    between them in the same order, so they cut the same messages in the same order."""
    groups: dict[tuple[int, int, str], list[int]] = {}
    for t in transfers:
        groups.setdefault((t.src, t.dst, t.op), []).append(t.chunk)
    out = []
    for (src, dst, op), chunks in groups.items():
        chunks.sort()
        first = chunks[0]
        for a, b in zip(chunks, chunks[1:] + [-1]):
            if b != a + 1:
                out.append(Message(src, dst, first, op, a + 1))  # type: ignore[arg-type]
                first = b
    return out


def messages_of(schedule: Schedule, rank: int) -> list[tuple[list[Message], list[Message]]]:
    """Per round, the messages ``rank`` sends and receives (what the executor posts)."""
    plan = []
    for sends, recvs in schedule.transfers_of(rank):
        into = {t.chunk for t in recvs}
        plan.append(([m._replace(snapshot=any(c in into for c in range(m.chunk, m.stop)))
                      for m in messages(sends)], messages(recvs)))
    return plan
