"""Pictures in the terminal, drawn with rich from the objects the engine runs (never typed in).

    from dplab.lessons.pictures_terminal import schedule_picture, bucket_timeline, memory_bars
    Step(..., picture=lambda f: schedule_picture(ring.reduce_scatter(f["p"])))
    Step(..., picture=lambda f: bucket_timeline(f["events"][0]))          # one rank's trace events
    Step(..., picture=lambda f: memory_bars({"replicas": {"params": 4e6, "grads": 4e6,
                                                          "optimizer": 8e6, "activations": 2e6}}))

``schedule_picture`` is ``reference/pictures.render_rounds`` (the pictures the algorithm files
carry) in colour; past what its notation draws (10 ranks, 26 chunks) it falls back to a table of the
same transfers. ``bucket_timeline`` scales a rank's real trace to the screen:
backward on one lane, each bucket's all-reduce on the next, so overlap is seen.
``memory_bars`` stacks what each rank holds. Each returns a rich renderable;
all read as plain text when piped (``Console`` decides).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dplab.lessons.plain import size
from dplab.reference.pictures import PictureError, render_rounds
from dplab.reference.schedule import Schedule

__all__ = ["schedule_picture", "schedule_table", "bucket_timeline", "memory_bars", "MEMORY_PARTS"]

MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
_PART_STYLE = {"params": ("█", "blue"), "grads": ("▓", "red"), "optimizer": ("▒", "green"),
               "activations": ("░", "yellow")}
_OTHER_STYLE = ("▪", "magenta")


def schedule_picture(schedule: Schedule, rounds: Iterable[int] | None = None,
                     title: str | None = None) -> Any:
    """The schedule's rounds as ``render_rounds`` draws them (what every rank holds, what it sends
    to whom), reduce arrows in yellow and copies in cyan; a ``schedule_table`` when the notation
    cannot draw it."""
    try:
        picture = render_rounds(schedule, rounds)
    except PictureError:
        return schedule_table(schedule, title=title)
    text = Text(picture)
    text.highlight_regex(r"--\w+-->", "yellow")
    text.highlight_regex(r"==\w+==>", "cyan")
    text.highlight_regex(r"(?m)^(round \d+|after round \d+)", "bold")
    return Panel(text, title=title, title_align="left", expand=False, border_style="dim")


def schedule_table(schedule: Schedule, max_rounds: int = 16, title: str | None = None) -> Table:
    """One row per round listing its transfers, ``r0→r1 c3+`` (rank 0 sends chunk 3 to rank 1, which
    adds it; ``=``: copies it); rounds past ``max_rounds`` are summarised in one line. Any world
    size: the row folds at the screen's edge."""
    table = Table(title=title, box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    table.add_column("round", justify="right", no_wrap=True)
    table.add_column(f"transfers (p = {schedule.world_size}, {schedule.num_chunks} chunks; + adds, "
                     "= copies)",
                     overflow="fold")
    for k, rnd in enumerate(schedule.rounds[:max_rounds]):
        moves = [f"r{t.src}→r{t.dst} c{t.chunk}{'+' if t.op == 'reduce' else '='}" for t in rnd]
        table.add_row(str(k), Text("  ".join(moves) or "·", style="yellow"))
    if len(schedule.rounds) > max_rounds:
        table.add_row("…", Text(f"{len(schedule.rounds) - max_rounds} more rounds", style="dim"))
    return table


def _get(e: Any, name: str, default: Any = None) -> Any:
    """An event's field, whether it is a ``trace.Event`` or its JSON dict."""
    if isinstance(e, Mapping):
        return e.get(name, e.get("extra", {}).get(name, default))
    value = getattr(e, name, None)
    return value if value is not None else getattr(e, "extra", {}).get(name, default)


def bucket_timeline(events: Iterable[Any], width: int = 60, backward: Sequence[str] = ("backward",),
                    reduce: Sequence[str] = ("bucket",), step: int | None = None) -> Any:
    """One rank's backward and bucket all-reduces on a shared time axis, ``width`` columns wide.

    ``events``: ``trace.Event`` objects or their dicts (one rank's; kinds in ``backward`` are drawn
    as ``█`` on the backward lane, kinds in ``reduce`` as their bucket's number on the all-reduce
    lane); ``step``: only that training step (``extra["step"]``), default all. A bucket drawn under
    the backward bar is communication hidden behind compute."""
    chosen = [e for e in events if _get(e, "kind") in (*backward, *reduce)
              and (step is None or _get(e, "step") == step)]
    if not chosen:
        return Text(f"(no {' or '.join((*backward, *reduce))} events to draw)", style="dim")
    t0 = min(_get(e, "t_start_ns") for e in chosen)
    t1 = max(_get(e, "t_end_ns") for e in chosen)
    span = max(t1 - t0, 1)

    def cols(e: Any) -> range:
        a = int((_get(e, "t_start_ns") - t0) * width / span)
        b = int(round((_get(e, "t_end_ns") - t0) * width / span))
        # at least one column: a short span stays seen
        return range(min(a, width - 1), max(b, a + 1))

    lanes = {"backward": [" "] * width, "all-reduce": [" "] * width}
    for e in chosen:
        is_back = _get(e, "kind") in backward
        mark = "█" if is_back else str(_get(e, "bucket", "?"))[-1]
        for c in cols(e):
            if c < width:
                lanes["backward" if is_back else "all-reduce"][c] = mark
    out = Text()
    for name, cells in lanes.items():
        out.append(f"{name:>10} │", style="bold")
        out.append("".join(cells), style="cyan" if name == "backward" else "yellow")
        out.append("│\n")
    out.append(f"{'':>10} └{'─' * width}┘ {_duration(span)}\n", style="dim")
    out.append(
        f"{'':>12}digits: the bucket being all-reduced; under █ it overlaps backward", style="dim"
    )
    return out


def _duration(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.0f} ns"


def memory_bars(per_rank: Mapping[str, Mapping[str, float]], width: int = 40) -> Any:
    """Stacked bars of bytes: ``{"rank 0" or "ZeRO-2": {"params": b, "grads": b, "optimizer": b,
    "activations": b}}``, one bar per entry, all on one scale (the largest total is ``width``
    columns), each part a glyph and a colour (readable without colour too), with its total."""
    if not per_rank:
        return Text("(nothing to draw)", style="dim")
    totals = {name: sum(float(v) for v in parts.values()) for name, parts in per_rank.items()}
    biggest = max(max(totals.values()), 1.0)
    seen: list[str] = []
    table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
    table.add_column("who", no_wrap=True, style="bold")
    table.add_column("bar", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    for name, parts in per_rank.items():
        bar = Text()
        order = [k for k in MEMORY_PARTS if k in parts] + [
            k for k in parts if k not in MEMORY_PARTS
        ]
        for part in order:
            n = round(float(parts[part]) * width / biggest)
            glyph, colour = _PART_STYLE.get(part, _OTHER_STYLE)
            if float(parts[part]) > 0:
                n = max(n, 1)  # a part that is there is seen
                seen += [part] if part not in seen else []
            bar.append(glyph * n, style=colour)
        table.add_row(name, bar, size(totals[name]))
    legend = Text()
    for part in seen:
        glyph, colour = _PART_STYLE.get(part, _OTHER_STYLE)
        legend.append(glyph, style=colour)
        legend.append(f" {part}  ", style="dim")
    return Group(table, legend)
