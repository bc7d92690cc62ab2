"""The timeline of a real run: one lane per rank and thread, one bar per recorded span.

Nothing here is re-enacted: the bars are the ``dplab.reference.trace.Event`` spans that the
trainers recorded while they ran (``run_train(..., trace=True)`` or ``dplab train --trace``).
A synchronous rank has two lanes, ``main`` (forward, backward, wait, optimizer, the loss's
all-reduce) and ``comm`` (each bucket's all-reduce, running while backward goes on); a
parameter-server worker has one (wait, pull, compute, push), the server one (reply, apply).

Spans nest (a bucket holds its all-reduce, which holds its sends and receive-and-adds); a
span's depth is how many spans of its lane enclose it. Depth 0 is drawn always, deeper
spans only with ``detail=True``, thinner, on top of their parent; a straggler's
``slowdown`` sleeps are drawn always, inside the compute they stretch.

    from dplab.backends.runs import RunSpec, run_train
    from dplab.viz.timeline import timeline_figure
    row, per_rank = run_train(RunSpec(world_size=4), trace=True)
    timeline_figure([e for events in per_rank for e in events]).show()
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from dplab.backends.runs import uploads
from dplab.reference.trace import Event, save_json, to_chrome

__all__ = ["Span", "lane_of", "lanes", "spans", "timeline_figure", "load_trace", "trace_bytes",
           "chrome_bytes", "KIND_COLORS", "ALWAYS"]

ALWAYS = frozenset({"slowdown"})  # drawn even when nested: the straggler's sleep is the story
KIND_COLORS = {
    "forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "compute": "#4C78A8",
    "wait": "#E45756", "bucket": "#F58518", "allreduce": "#EECA3B", "broadcast": "#B279A2",
    "send": "#9D755D", "reduce": "#FF9DA6", "copy": "#BAB0AC", "slowdown": "#222222",
    "pull": "#B279A2", "push": "#F58518", "reply": "#B279A2", "apply": "#54A24B",
    "drop": "#BAB0AC", "stop": "#E45756", "lost": "#000000",
}
WIDTHS = (0.8, 0.5, 0.3, 0.2)  # bar thickness by depth


def lane_of(e: Event) -> str:
    return f"rank {e.rank} · {e.thread}"


def lanes(events: Iterable[Event]) -> list[str]:
    """Lane labels top to bottom: by rank, ``main`` before ``comm``."""
    keys = {(e.rank, e.thread != "main", e.thread) for e in events}
    return [f"rank {r} · {t}" for r, _, t in sorted(keys)]


@dataclass(frozen=True)
class Span:
    """One bar: times in milliseconds from the trace's first event."""

    lane: str
    kind: str
    start_ms: float
    dur_ms: float
    depth: int
    label: str  # what the event's extra fields say: step, bucket, clock, peer
    event: Event


def _label(e: Event) -> str:
    parts = [
        f"{k} {v}"
        for k, v in e.extra.items()
        if k in ("step", "micro", "bucket", "clock", "version", "delay", "factor")
    ]
    if e.peer >= 0:
        parts.append(f"peer {e.peer}")
    if e.round >= 0:
        parts.append(f"round {e.round}, chunk {e.chunk}")
    if e.bytes:
        parts.append(f"{e.bytes:,} B")
    if e.algorithm:
        parts.append(e.algorithm)
    return ", ".join(str(p) for p in parts)


def spans(events: Sequence[Event], detail: bool = False) -> list[Span]:
    """Every event as a bar with its nesting depth in its lane; depth > 0 only with ``detail``."""
    t0 = min((e.t_start_ns for e in events), default=0)
    by_lane: dict[str, list[Event]] = {}
    for e in events:
        by_lane.setdefault(lane_of(e), []).append(e)
    out = []
    for lane, evs in by_lane.items():
        stack: list[int] = []  # end times of the spans enclosing the current one
        for e in sorted(evs, key=lambda e: (e.t_start_ns, -e.t_end_ns)):
            while stack and stack[-1] <= e.t_start_ns:
                stack.pop()
            depth = len(stack)
            stack.append(e.t_end_ns)
            if depth == 0 or detail or e.kind in ALWAYS:
                out.append(
                    Span(
                        lane,
                        e.kind,
                        (e.t_start_ns - t0) / 1e6,
                        (e.t_end_ns - e.t_start_ns) / 1e6,
                        depth,
                        _label(e),
                        e,
                    )
                )
    return out


def timeline_figure(events: Sequence[Event], detail: bool = False, title: str = "") -> go.Figure:
    """Horizontal bars (``go.Bar`` with ``base``), one trace per kind so the legend names them."""
    bars = spans(events, detail)
    order = lanes(events)
    fig = go.Figure()
    known = list(KIND_COLORS)
    kinds = sorted(
        {s.kind for s in bars}, key=lambda k: (known.index(k) if k in known else len(known), k)
    )
    for kind in kinds:
        mine = [s for s in bars if s.kind == kind]
        fig.add_trace(
            go.Bar(
                name=kind,
                orientation="h",
                y=[s.lane for s in mine],
                x=[s.dur_ms for s in mine],
                base=[s.start_ms for s in mine],
                width=[WIDTHS[min(s.depth, len(WIDTHS) - 1)] for s in mine],
                marker_color=KIND_COLORS.get(kind, "#888888"),
                customdata=[[s.label, s.start_ms + s.dur_ms] for s in mine],
                hovertemplate=(
                    f"<b>{kind}</b> %{{y}}<br>%{{base:.3f}} → %{{customdata[1]:.3f}} ms "
                    "(%{x:.3f} ms)<br>%{customdata[0]}<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        title=title or None, barmode="overlay", height=90 + 34 * len(order),
        xaxis_title="ms since the first event", legend_title="span",
        yaxis={"categoryorder": "array", "categoryarray": order, "autorange": "reversed"},
        margin={"l": 10, "r": 10, "t": 40 if title else 10, "b": 40})
    return fig


def load_trace(data: bytes) -> tuple[list[Event], dict[str, Any]]:
    """The events and meta of a trace file written by ``dplab train --trace PATH``, checked whole
    first (``dplab.backends.runs.uploads.trace``: size, types, ranges), since anyone may upload
    one."""
    return uploads.trace(data)


def trace_bytes(events: Iterable[Event], meta: dict[str, Any] | None = None) -> bytes:
    """A trace file as ``dplab train --trace PATH`` writes it (``save_json``);
    ``load_trace`` reads it."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        save_json(path, events, meta)
        return path.read_bytes()


def chrome_bytes(events: Iterable[Event], cluster: str = "") -> bytes:
    """The Chrome-trace JSON of ``events`` (open it in ui.perfetto.dev or chrome://tracing);
    ``cluster``: they are that simulated cluster's time, and the trace says so."""
    return json.dumps(to_chrome(events, cluster)).encode()
