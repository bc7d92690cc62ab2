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
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from dplab.reference.errors import DplabError

__all__ = ["Op", "Transfer", "Schedule", "ScheduleError", "validate", "chunk_bounds", "concat",
           "Message", "messages", "messages_of"]

Op = Literal["reduce", "copy"]


class ScheduleError(DplabError, ValueError):
    """A schedule that cannot be executed as written."""


@dataclass(frozen=True)
class Transfer:
    """One send in a round: rank ``src`` sends chunk ``chunk`` to ``dst``, which adds or copies it.

    Args:
        src: the sending rank.
        dst: the receiving rank.
        chunk: the chunk's index (``chunk_bounds(n, num_chunks)[chunk]`` of the buffer).
        op: "reduce" (the receiver adds it to its own) or "copy" (it overwrites its own).
    """
    src: int
    dst: int
    chunk: int
    op: Op


@dataclass(frozen=True, eq=False)
class Schedule:
    """``rounds[k]`` lists the transfers of round k; all of them may run at once. Immutable, and
    checked when made (``validate``).

    Args:
        name: the algorithm's name, shown in traces and pictures.
        world_size: the number of ranks.
        num_chunks: how many chunks the buffer is cut into (``chunk_bounds``).
        rounds: the transfers of each round.

    Raises:
        ScheduleError: a transfer that cannot run as written (``validate``).
    """

    name: str
    world_size: int
    num_chunks: int
    rounds: tuple[tuple[Transfer, ...], ...]
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", tuple(tuple(rnd) for rnd in self.rounds))
        validate(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        key = lambda s: (s.name, s.world_size, s.num_chunks, s.rounds)  # noqa: E731
        return key(self) == key(other)

    def __hash__(self) -> int:
        return hash((self.name, self.world_size, self.num_chunks, len(self.rounds)))

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, world_size={self.world_size}, "
                f"num_chunks={self.num_chunks}, {len(self.rounds)} rounds, "
                f"{sum(map(len, self.rounds))} transfers)")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled without what ``memo`` keeps (``st.cache_data`` and persistent worlds pickle
        schedules)."""
        return (Schedule, (self.name, self.world_size, self.num_chunks, self.rounds))

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per schedule and key (the cost model keeps its columns and summaries
        here).

        Args:
            key: what the value is of (e.g. "columns").
            compute: makes the value the first time.

        Returns:
            The value kept for ``key``.
        """
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def transfers_of(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """Per round, the (sends, receives) that ``rank`` takes part in, in schedule order.

        Args:
            rank: the rank.

        Returns:
            One (sends, receives) pair per round.
        """
        return [
            ([t for t in rnd if t.src == rank], [t for t in rnd if t.dst == rank])
            for rnd in self.rounds
        ]


def validate(s: Schedule) -> None:
    """Refuse what cannot run as written: a rank or chunk out of range, an unknown op, a send to
    oneself, and two receives into one chunk in one round when one of them is a copy (a copy
    overwrites: which lands last would be undefined). A rank may send a chunk it also receives
    into (recursive doubling's exchange): the send carries the chunk as the round found it.

    Args:
        s: the schedule.

    Raises:
        ScheduleError: naming the round and the transfer.
    """
    p, k = s.world_size, s.num_chunks
    if p < 1 or k < 1:
        raise ScheduleError(f"{s.name}: world_size and num_chunks must be >= 1, got {p}, {k}")
    for i, rnd in enumerate(s.rounds):
        into: dict[tuple[int, int], list[str]] = {}  # (rank, chunk) -> the ops received into it
        for t in rnd:
            if not isinstance(t, Transfer):
                raise ScheduleError(f"{s.name} round {i}: {t!r} is not a Transfer(src, dst, chunk, "
                                    "op)")
            if t.op not in ("reduce", "copy"):
                raise ScheduleError(f"{s.name} round {i}: unknown op {t.op!r} in {t}: a transfer "
                                    "either 'reduce's or 'copy's")
            # ints, numpy ints (three hasattr, not a generator: validate runs per transfer)
            if not (hasattr(t.src, "__index__") and hasattr(t.dst, "__index__")
                    and hasattr(t.chunk, "__index__")):
                raise ScheduleError(f"{s.name} round {i}: {t}: src, dst and chunk must be integers "
                                    "(p // 2, not p / 2)")
            if not (0 <= t.src < p and 0 <= t.dst < p and 0 <= t.chunk < k):
                raise ScheduleError(f"{s.name} round {i}: {t} is out of range (p={p}, k={k})")
            if t.src == t.dst:
                raise ScheduleError(f"{s.name} round {i}: {t} sends to itself")
            ops = into.setdefault((t.dst, t.chunk), [])
            ops.append(t.op)
            if len(ops) > 1 and "copy" in ops:
                raise ScheduleError(f"{s.name} round {i}: rank {t.dst} receives chunk {t.chunk} "
                                    "twice, once as a copy: which lands last is undefined")


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """Split range(n) into k contiguous pieces; the first ``n % k`` get one extra element.

    Works for any n >= 0 including n < k (trailing pieces are empty). The same rule
    shards a global batch over ranks.

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]

    Args:
        n: the number of elements (>= 0).
        k: the number of pieces (>= 1).

    Returns:
        k (start, stop) pairs, in order, covering range(n).

    Raises:
        ValueError: n < 0 or k < 1.
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
    """Run schedules one after another over the same chunking (e.g. reduce-scatter + all-gather).

    Args:
        name: the new schedule's name.
        *parts: the schedules, in the order they run.

    Returns:
        One schedule with all their rounds.

    Raises:
        ScheduleError: the parts differ in world_size or num_chunks.
    """
    p, k = parts[0].world_size, parts[0].num_chunks
    if any(s.world_size != p or s.num_chunks != k for s in parts):
        raise ScheduleError(f"{name}: parts disagree on world_size or num_chunks")
    return Schedule(name, p, k, tuple(rnd for s in parts for rnd in s.rounds))


class Message(NamedTuple):
    """What travels: a round's transfers from ``src`` to ``dst`` with one op and consecutive chunks
    go as one message, chunks ``chunk .. stop - 1`` (Rabenseifner's half-buffers: one message, one
    alpha). ``snapshot``: the sender also receives into one of these chunks in the same round, so
    the executor sends a copy taken at the start of the round (what the schedule's send means).

    Args:
        src: the sending rank.
        dst: the receiving rank.
        chunk: the first chunk.
        op: "reduce" or "copy".
        stop: one past the last chunk.
        snapshot: send a copy taken at the start of the round.
    """

    src: int
    dst: int
    chunk: int
    op: Op
    stop: int
    snapshot: bool = False


def messages(transfers: Iterable[Transfer]) -> list[Message]:
    """Coalesce transfers (of one round) into messages: per (src, dst, op), in order of first
    appearance, each run of consecutive chunks. Sender and receiver see the same transfers
    between them in the same order, so they cut the same messages in the same order.

    Args:
        transfers: the transfers of one round.

    Returns:
        The messages, each a run of consecutive chunks between one pair with one op.
    """
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
    """Per round, the messages ``rank`` sends and receives (what the executor posts).

    Args:
        schedule: the schedule.
        rank: the rank.

    Returns:
        One (sends, receives) pair of message lists per round.
    """
    plan = []
    for sends, recvs in schedule.transfers_of(rank):
        into = {t.chunk for t in recvs}
        plan.append(([m._replace(snapshot=any(c in into for c in range(m.chunk, m.stop)))
                      for m in messages(sends)], messages(recvs)))
    return plan
