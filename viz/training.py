"""The Training page's figures: sync vs backup workers vs a staleness grid, with and without a
straggler.

Pure builders (no Streamlit): they take the ``Cell``s of ``dplab.viz.training_runs.run_grid``
(real runs of ``dplab compare``'s grid) and return plotly figures and table rows, so the
lessons and the tests use them as the page does:

    from dplab.viz.training_runs import TrainingGrid, run_grid
    from dplab.viz.training import loss_figure, delay_figure, equivalence_figure, summary_rows
    cells = run_grid(TrainingGrid())
    loss_figure(cells, "time").show()

Two words that the issue's "staleness histogram" runs together (the glossary in the README):
staleness counts CLOCKS (SSP's bound, ``--staleness``); the histogram here counts, per applied
gradient, its DELAY in UPDATES (``LogEntry.delay``: other updates the server applied between
the pull it was computed on and its own update), straight from the server's log.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab.viz.training_runs import Cell

__all__ = ["loss_figure", "throughput_figure", "delay_counts", "delay_figure", "equivalence_figure",
           "summary_rows", "straggler_cost", "short_label", "tolerance", "X_TITLES", "X_NOTES",
           "RELATIVE_TOL"]

# the axis titles, short enough for a half-width chart; what they mean goes in the page's caption
X_TITLES = {"step": "steps (global batches applied)", "time": "wall time (s)"}
X_NOTES = {
    "step": "a step is one global batch of gradients applied: a sync step, or W async updates",
    "time": "seconds from the run's first traced event",
}
# sync vs one device agree to ROUNDING: max|a - b| <= 1e-10 * max(1, max|b|) in float64 (the tests'
# rel)
RELATIVE_TOL = 1e-10
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _colours(cells: Sequence[Cell]) -> dict[str, str]:
    """One colour per configuration (the row's ``algorithm``), the same in every figure."""
    labels = list(dict.fromkeys(c.label for c in cells))
    return {lab: _PALETTE[i % len(_PALETTE)] for i, lab in enumerate(labels)}


def _name(cell: Cell) -> str:
    return f"{cell.label}" + ("" if cell.straggler == "none" else f" · straggler {cell.straggler}")


def loss_figure(cells: Sequence[Cell], x: str = "step") -> go.Figure:
    """Loss over the whole data set against steps or wall time; dotted: the straggler's runs."""
    if x not in X_TITLES:
        raise ValueError(f"x must be one of {', '.join(X_TITLES)}, got {x!r}")
    colour = _colours(cells)
    fig = go.Figure()
    for c in cells:
        fig.add_trace(
            go.Scatter(
                x=c.steps if x == "step" else c.times_s,
                y=c.losses,
                name=_name(c),
                mode="lines+markers",
                legendgroup=c.label,
                marker={"size": 4},
                line={
                    "color": colour[c.label],
                    "dash": "solid" if c.straggler == "none" else "dot",
                },
                hovertemplate="%{x:.3g}, loss %{y:.5g}<extra>" + _name(c) + "</extra>",
            )
        )
    clock = "wall time"
    x_title = X_TITLES[x]
    if x == "time" and cells and cells[0].row.get("clock") == "simulated":  # a simulated cluster's
        clock, x_title = "simulated time", f"simulated time on {cells[0].row['cluster']} (s)"
    fig.update_layout(title=f"loss against {'steps' if x == 'step' else clock}",
                      xaxis_title=x_title, yaxis_title="loss (mean over the data set)",
                      legend={"orientation": "h", "y": -0.25}, margin={"t": 40})
    return fig


def throughput_figure(cells: Sequence[Cell]) -> go.Figure:
    """``samples_per_s`` of every row: samples whose gradients reached the parameters, per
    second."""
    fig = go.Figure()
    for straggler in dict.fromkeys(c.straggler for c in cells):
        group = [c for c in cells if c.straggler == straggler]
        fig.add_trace(
            go.Bar(
                x=[c.label for c in group],
                y=[c.row["samples_per_s"] for c in group],
                name="no straggler" if straggler == "none" else f"straggler {straggler}",
                text=[f"{c.row['samples_per_s']:,.0f}" for c in group],
                textposition="outside",
            )
        )
    simulated = bool(cells) and cells[0].row.get("clock") == "simulated"
    fig.update_layout(barmode="group", title="throughput (samples applied per second"
                      + (f" of simulated time on {cells[0].row['cluster']})" if simulated else ")"),
                      yaxis_title="samples / s", margin={"t": 40})
    return fig


def delay_counts(cell: Cell) -> dict[int, int]:
    """How many applied gradients had each delay (in updates), from the server's log; sorted."""
    return dict(sorted(Counter(cell.delays).items()))


def delay_figure(cells: Sequence[Cell]) -> go.Figure:
    """The parameter server's delay histogram per run: one panel per straggler setting."""
    ps = [c for c in cells if c.row["mode"] != "sync"]
    stragglers = list(dict.fromkeys(c.straggler for c in ps)) or ["none"]
    titles = ["no straggler" if s == "none" else f"straggler {s}" for s in stragglers]
    fig = make_subplots(rows=1, cols=len(stragglers), subplot_titles=titles, shared_yaxes=True)
    colour = _colours(cells)
    for col, straggler in enumerate(stragglers, start=1):
        for c in (c for c in ps if c.straggler == straggler):
            counts = delay_counts(c)
            fig.add_trace(
                go.Bar(
                    x=list(counts),
                    y=list(counts.values()),
                    name=_name(c),
                    legendgroup=c.label,
                    marker_color=colour[c.label],
                    showlegend=col == 1 or straggler == "none",
                    hovertemplate="delay %{x}: %{y} gradients<extra>" + _name(c) + "</extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(
            title_text="delay (updates between a gradient's pull and its apply)",
            dtick=1,
            row=1,
            col=col,
        )
    fig.update_yaxes(title_text="applied gradients", row=1, col=1)
    fig.update_layout(barmode="group", margin={"t": 60},
                      title="delay histogram from the server's log (LogEntry.delay, in updates; "
                            "staleness bounds clocks)")
    return fig


def short_label(label: str) -> str:
    """A configuration's name without the server's prefix: ``ring``, ``backup b=1``, ``s=0``."""
    return label.removeprefix("ps ")


def tolerance(cells: Sequence[Cell]) -> float:
    """The absolute tolerance the sync runs must stay under: 1e-10 * max(1, max |final params|)."""
    scale = max((float(np.max(np.abs(c.params), initial=0.0)) for c in cells
                 if c.row["mode"] == "sync" and c.params is not None), default=0.0)
    return RELATIVE_TOL * max(1.0, scale)


def equivalence_figure(cells: Sequence[Cell]) -> go.Figure:
    """Per step k, max |sync params_k - train_single(steps=k)|: rounding, never drift.

    A log axis that spans from below the smallest difference up past the tolerance (dashed line),
    so rounding (~1e-16) reads as six orders of magnitude under it, not as a jump between two
    rounding-level values. A step that is exactly 0 has no point on a log axis."""
    fig = go.Figure()
    seen = set()
    for c in (c for c in cells if c.row["mode"] == "sync" and c.diffs):
        if c.label in seen:
            # a straggler's run has the same bits (checked: same_bits), so the same curve
            continue
        seen.add(c.label)
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(c.diffs) + 1)),
                y=c.diffs,
                mode="lines+markers",
                name=f"{c.label} (every straggler setting: same bits)",
                hovertemplate="step %{x}: %{y:.3g}<extra></extra>",
            )
        )
    tol = tolerance(cells)
    positive = [d for t in fig.data for d in t.y if d > 0]
    low = math.floor(math.log10(min(positive, default=tol * 1e-6))) - 1
    high = math.ceil(math.log10(tol)) + 1
    fig.add_hline(y=tol, line_dash="dash", line_color="#d62728")
    # on a log axis an annotation's y is the exponent (add_hline's own annotation would land at
    # y=1e-10)
    fig.add_annotation(
        x=1,
        xref="paper",
        xanchor="right",
        y=math.log10(tol),
        yref="y",
        yanchor="top",
        text=f"tolerance {tol:.0e} (relative {RELATIVE_TOL:.0e})",
        showarrow=False,
        font={"color": "#d62728"},
    )
    fig.update_layout(title="sync: max_abs_diff_vs_single per step", xaxis_title="step",
                      yaxis_title="max |params − single-device params|", yaxis_type="log",
                      yaxis_range=[low, high], yaxis_dtick=1, yaxis_exponentformat="power",
                      margin={"t": 40})
    return fig


def straggler_cost(cells: Sequence[Cell]) -> dict[str, float]:
    """Per configuration: throughput with the straggler over throughput without (1: unharmed)."""
    base = {c.label: c.row["samples_per_s"] for c in cells if c.straggler == "none"}
    return {c.label: c.row["samples_per_s"] / base[c.label] for c in cells
            if c.straggler != "none" and base.get(c.label)}


def summary_rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """The rows of ``dplab compare`` that the figures come from, with the curve's own checks."""
    out = []
    for c in cells:
        r = c.row
        out.append({
            "run": c.label, "straggler": c.straggler, "final_loss": r["final_loss"],
            "samples_per_s": r["samples_per_s"], "wall_s": r["wall_s"], "updates": r["updates"],
            "max_delay": r.get("max_delay"), "dropped": r.get("dropped"),
            "max_abs_diff_vs_single": r.get("max_abs_diff_vs_single"),
            # the log replays / the per-step run's bits
            "exact": r.get("replay_exact", c.same_bits),
        })
    return out
