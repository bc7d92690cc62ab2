"""Text pictures drawn from the code that runs: schedules (through the simulator) and traces.

The docstrings' pictures are these renderings, pasted; the output depends only on the input, and
``tests/test_pictures_docs.py`` fails when a docstring's picture differs from it.

    >>> from dplab.reference.algorithms import ring
    >>> print(render_rounds(ring.reduce_scatter(2)))
    p = 2, chunks a b; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0]  --b0--> r1
      r1 [a1 b1]  --a1--> r0
    after round 0
      r0 [a01 b0]
      r1 [a1  b01]

    python -m tests.test_pictures_docs     # print every docstring picture as the code draws it
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dplab.reference.errors import DplabError
from dplab.reference.schedule import Schedule
from dplab.reference.simulate import simulate
from dplab.reference.trace import Event

__all__ = ["PictureError", "contents", "render_rounds", "render_arrows", "render_tree",
           "render_timeline"]


class PictureError(DplabError, ValueError):
    """A picture that cannot be drawn faithfully (too many ranks for the notation, overlapping
    spans)."""


def _chunk_name(c: int) -> str:
    if c >= 26:
        raise PictureError(
            f"chunk {c}: the text notation names chunks a..z; draw at most 26 chunks"
        )
    return chr(ord("a") + c)


def contents(chunk: int, counts: np.ndarray) -> str:
    """``"b02"``: chunk b holding rank 0's and rank 2's contributions (a digit per time it is held).

    A contribution held twice shows twice ("a001"): the double counting the simulator exists
    to catch stays visible in the picture.

    Args:
        chunk: the chunk's index (a letter: at most 26).
        counts: how many times each rank's contribution is in it.

    Returns:
        The chunk's label.

    Raises:
        PictureError: more than 10 ranks, or more than 26 chunks.
    """
    if len(counts) > 10:
        raise PictureError(f"{len(counts)} ranks: the one-digit notation draws at most 10 ranks")
    return _chunk_name(chunk) + "".join(str(r) * int(n) for r, n in enumerate(counts))


def _states(holding: np.ndarray) -> list[str]:
    """Every rank's chunks as ``[a0  b02 c0]``, each chunk's column as wide as its widest entry."""
    p, k = holding.shape[:2]
    cells = [[contents(c, holding[r, c]) for c in range(k)] for r in range(p)]
    widths = [max(len(row[c]) for row in cells) for c in range(k)]
    return ["[" + " ".join(x.ljust(w) for x, w in zip(row[:-1], widths)) + (" " if k > 1 else "")
            + row[-1] + "]" for row in cells]


def _sends(holding: np.ndarray, rnd: Sequence, rank: int) -> str:
    """This rank's sends of a round, one arrow per (chunk, op), its destinations after it."""
    groups: dict[tuple[int, str], list[int]] = {}
    for t in rnd:
        if t.src == rank:
            groups.setdefault((t.chunk, t.op), []).append(t.dst)
    arrows = []
    for (chunk, op), dsts in groups.items():
        x, line = contents(chunk, holding[rank, chunk]), "--" if op == "reduce" else "=="
        arrows.append(f"{line}{x}{line}> " + " ".join(f"r{d}" for d in dsts))
    return "  ".join(arrows)


def render_rounds(schedule: Schedule, rounds: Iterable[int] | None = None) -> str:
    """Per round: what every rank holds at its start and what it sends; then the state after.

    Holdings come from the simulator (``dplab.reference.simulate``), which runs the very
    schedule the executor runs, so a send's label is the value it really carries.

    Args:
        schedule: the schedule.
        rounds: the rounds to draw (default: all).

    Returns:
        The picture, lines joined by newlines.

    Raises:
        PictureError: more than 10 ranks or 26 chunks.
    """
    sim = simulate(schedule)
    p, k = schedule.world_size, schedule.num_chunks
    shown = list(range(len(schedule.rounds)) if rounds is None else rounds)
    names = " ".join(_chunk_name(c) for c in range(k))
    lines = [f'p = {p}, chunk{"s" if k > 1 else ""} {names}; "a01" holds rank 0\'s and rank 1\'s '
             "parts of chunk a", "--x--> the receiver adds x, ==x==> it copies x"]
    for i in shown:
        h = sim.holdings[i]
        states = _states(h)
        width = max(len(s) for s in states)
        lines.append(f"round {i}")
        lines += [f"  r{r} {states[r]:<{width}}  {_sends(h, schedule.rounds[i], r)}".rstrip()
                  for r in range(p)]
    if shown:
        lines.append(f"after round {shown[-1]}")
        lines += [f"  r{r} {state}" for r, state in enumerate(_states(sim.holdings[shown[-1] + 1]))]
    return "\n".join(lines)


def render_arrows(schedule: Schedule) -> str:
    """One line per round: ``src->dst`` for every transfer (chunk letters when there are
    several).

    Args:
        schedule: the schedule.

    Returns:
        The picture.
    """
    lines = []
    for i, rnd in enumerate(schedule.rounds):
        ops = sorted({"adds" if t.op == "reduce" else "copies" for t in rnd})
        arrows = [f"{t.src}->{t.dst}" if schedule.num_chunks == 1
                  else f"{t.src}-{_chunk_name(t.chunk)}->{t.dst}" for t in rnd]
        lines.append(f"round {i} ({'/'.join(ops)}):  " + "   ".join(arrows))
    return "\n".join(lines)


def render_tree(schedule: Schedule) -> str:
    """The reduction tree a schedule builds: one line per leaf, its path to the root.

    A rank's parent is the rank it sends to with ``op='reduce'``; a leaf receives from nobody.

    Args:
        schedule: a reducing schedule.

    Returns:
        One "root <- ... <- leaf" line per leaf.
    """
    parent = {t.src: t.dst for rnd in schedule.rounds for t in rnd if t.op == "reduce"}
    senders_to = {t.dst for rnd in schedule.rounds for t in rnd if t.op == "reduce"}
    lines = []
    for leaf in sorted(r for r in parent if r not in senders_to):
        path = [leaf]
        while path[-1] in parent:
            path.append(parent[path[-1]])
        lines.append(" <- ".join(str(r) for r in reversed(path)))
    return "\n".join(lines)


def _lane_of(e: Event) -> str:
    return f"rank {e.rank} {e.thread}"


def _label_of(e: Event) -> str:
    return str(e.extra.get("label", e.kind))


def render_timeline(
    events: Iterable[Event],
    unit_ns: int,
    *,
    lane: Callable[[Event], str] = _lane_of,
    label: Callable[[Event], str] = _label_of,
    marks: Mapping[str, str] | None = None,
    lanes: Sequence[str] | None = None,
    tick_every: int = 10,
) -> str:
    """Lanes of spans on a time grid of one character per ``unit_ns``.

    A span is ``[ label ]`` filling the columns of [t_start, t_end) (the label is cut to fit);
    an event whose kind is in ``marks`` is that one character at its end time (an update
    applied, a gradient dropped). Lanes come in ``lanes`` order, else in order of first
    appearance. Two things in one cell raise PictureError rather than hide each other: pick
    a finer ``unit_ns`` or another ``lane``. Times are integers, rounded to the nearest
    column, so the same events always draw the same picture.

    Args:
        events: the trace events to draw.
        unit_ns: nanoseconds per character.
        lane: an event's lane name (default: rank and thread).
        label: a span's label (default: its kind).
        marks: event kinds drawn as one character at their end time.
        lanes: the lanes, in order (default: as they first appear).
        tick_every: columns between the time axis's ticks.

    Returns:
        The picture, with a time axis.

    Raises:
        PictureError: ``unit_ns`` <= 0, an event on a lane not in ``lanes``, or two things in one
            cell.
    """
    events = list(events)
    if unit_ns <= 0:
        raise PictureError(f"unit_ns must be > 0, got {unit_ns}")
    marks = marks or {}
    t0 = min((e.t_start_ns for e in events), default=0)

    def col(t: int) -> int:
        return (t - t0 + unit_ns // 2) // unit_ns

    order = list(lanes or dict.fromkeys(lane(e) for e in events))
    rows: dict[str, dict[int, str]] = {name: {} for name in order}
    for e in events:
        name = lane(e)
        if name not in rows:
            raise PictureError(f"event {e.kind!r} is on lane {name!r}, which is not in "
                               f"lanes={order}")
        if e.kind in marks:
            start, text = col(e.t_end_ns), marks[e.kind]
        else:
            start, width = col(e.t_start_ns), col(e.t_end_ns) - col(e.t_start_ns)
            text = (
                "[" + label(e)[: max(width - 2, 0)].center(max(width - 2, 0)) + "]"
                if width >= 2
                else "|" * width
            )
        for i, ch in enumerate(text, start):
            if i in rows[name]:
                raise PictureError(f"lane {name!r}: {e.kind!r} overlaps another event at column "
                                   f"{i}; use a finer unit_ns or put them on separate lanes")
            rows[name][i] = ch
    end = max((max(r, default=-1) + 1 for r in rows.values()), default=0)
    pad = max([len(n) for n in order] + [len("time ->")]) + 2
    axis = [" "] * end
    for c in range(0, end, tick_every):
        tick = str(c * unit_ns)
        axis[c: c + len(tick)] = tick
    lines = ["time ->".ljust(pad) + "".join(axis)]
    lines += [
        name.ljust(pad) + "".join(r.get(i, " ") for i in range(end)) for name, r in rows.items()
    ]
    return "\n".join(line.rstrip() for line in lines)
