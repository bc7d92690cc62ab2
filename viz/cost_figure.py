"""The Cost page's figure: model curves, crossover markers, measured rows and fitted curves.

    from dplab.viz.cost import CostParams
    from dplab.viz.cost_figure import cost_figure
    cost_figure(CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8)).show()

Coinciding curves (``cost_crossovers.coinciding``) are dashed after the first, so every one of
them stays visible; coinciding crossovers are one marker.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from dplab.reference.algorithms import ALLREDUCE
from dplab.viz.cost import COLORS, DASHES, Y_AXES, CostParams, curves, features, model_time, to_y
from dplab.viz.cost_crossovers import coinciding, merged_crossovers

__all__ = ["cost_figure"]


def cost_figure(params: CostParams, y: str = "time", points: int = 97,
                measured: list[dict[str, Any]] | None = None,
                fitted: dict[tuple[str, str], tuple[float, float]] | None = None) -> go.Figure:
    """Model curves, crossover markers, and optionally bench rows and fitted curves at this p.

    ``measured``: bench rows (``dplab bench --json``); only those at ``params.world_size`` are
    drawn, one marker symbol per backend. ``fitted``: (backend, algorithm) -> (alpha s, beta s/B),
    drawn dashed over the same sizes as the rows.
    """
    p = params.world_size
    fig = go.Figure()
    c = curves(params, points)
    position = {a: (g[0], g.index(a)) for g in coinciding(params, points) for a in g}
    for a, (sizes, times) in c.items():
        first, i = position.get(a, (a, 0))
        name = f"{a} (model)" if i == 0 else f"{a} = {first} (model)"
        fig.add_trace(go.Scatter(x=sizes, y=to_y(sizes, times, p, y).tolist(), mode="lines",
                                 name=name, legendgroup=a,
                                 line={"color": COLORS[a], "dash": DASHES[i % len(DASHES)],
                                       "width": 2 + (i > 0)},
                                 hovertemplate="%{x:,} B: %{y:.4g}<extra>" + a + "</extra>"))
    xs = merged_crossovers(params, points)
    if xs:
        n = [x.nbytes for x in xs]
        t = [model_time(x.faster_below[0], x.nbytes, params) for x in xs]
        fig.add_trace(
            go.Scatter(
                x=n,
                y=to_y(n, t, p, y).tolist(),
                mode="markers+text",
                name="crossovers",
                marker={"symbol": "x", "size": 11, "color": "black"},
                text=[f"<b>{i}</b>" for i in range(1, len(xs) + 1)],  # as the captions
                textfont={"size": 15, "color": "black"},  # alternate sides: they bunch up
                textposition=[("top center", "bottom center")[i % 2] for i in range(len(n))],
                hovertext=[x.sentence() for x in xs],
                hoverinfo="text",
            )
        )
    symbols = ["circle", "square", "diamond", "triangle-up", "cross"]
    rows = [
        r for r in measured or [] if r.get("world_size") == p and r.get("algorithm") != "memcpy"
    ]
    backends = sorted({r["backend"] for r in rows})
    for (backend, alg) in sorted({(r["backend"], r["algorithm"]) for r in rows}):
        mine = sorted((r for r in rows if (r["backend"], r["algorithm"]) == (backend, alg)),
                      key=lambda r: r["bytes"])
        n = [r["bytes"] for r in mine]
        t = [r["time_us"] * 1e-6 for r in mine]
        fig.add_trace(
            go.Scatter(
                x=n,
                y=to_y(n, t, p, y).tolist(),
                mode="markers",
                name=f"{alg} ({backend}, measured)",
                legendgroup=alg,
                marker={
                    "color": COLORS.get(alg, "black"),
                    "size": 9,
                    "symbol": symbols[backends.index(backend) % len(symbols)],
                },
            )
        )
        if fitted and (backend, alg) in fitted and alg in ALLREDUCE:
            al, be = fitted[(backend, alg)]
            ft = [al * fa + be * fb for fa, fb in (features(alg, p, k, params.itemsize) for k in n)]
            fig.add_trace(go.Scatter(x=n, y=to_y(n, ft, p, y).tolist(), mode="lines",
                                     name=f"{alg} ({backend}, fitted)", legendgroup=alg,
                                     line={"color": COLORS[alg], "dash": "dash"}))
    fig.update_layout(
        title=f"All-reduce at p={p}: α={params.alpha_s * 1e6:.3g} µs, "
        f"β={params.beta_gbps:g} GB/s, "
        f"γ={'free' if params.gamma_gbps is None else f'{params.gamma_gbps:g} GB/s'}",
        xaxis={"title": "message size (bytes)", "type": "log"},
        yaxis={"title": Y_AXES[y], "type": "log"},
        # above the plot, under the title: below it, it covered the x axis' title
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"},
        margin={"t": 130, "b": 10},  # room for a legend of two rows under the title
    )
    return fig
