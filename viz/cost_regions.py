"""Which all-reduce the cost model picks at every (world size, message size): a map of regions.

Every cell is ``dplab.reference.costmodel.best_regions``: all registered schedules priced on a
topology (``dplab.reference.topology.PRESETS``), the cheapest one's name. It shows why the
engines switch: recursive doubling (lg p alphas) for small messages, Rabenseifner or the ring
(2 (p-1)/p n bytes) for large ones, and on a two-level cluster the hierarchical all-reduce,
which moves only a g-th of the bytes over the slow links.

    from dplab.reference.costmodel import best_regions
    from dplab.reference.topology import PRESETS
    from dplab.viz.cost_regions import WORLD_SIZES, REGION_SIZES, regions_figure
    regions_figure(best_regions(PRESETS["dgx-h100"], WORLD_SIZES, REGION_SIZES)).show()
"""

from __future__ import annotations

import plotly.graph_objects as go

from dplab.reference.costmodel import Regions

__all__ = ["WORLD_SIZES", "REGION_SIZES", "PALETTE", "regions_figure", "regions_rows", "size_label"]

WORLD_SIZES = tuple(2 ** k for k in range(1, 13))  # 2 .. 4096
REGION_SIZES = tuple(1 << k for k in range(10, 31, 2))  # 1 KiB .. 1 GiB, every factor of 4
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939")


def size_label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def regions_figure(regions: Regions) -> go.Figure:
    """A heat map: world size up (log, one row per p), message size across, colour = the winner.

    Only algorithms that win somewhere get a colour; hovering a cell gives the winner, its time
    and how much slower the runner-up is."""
    win = regions.winner
    used = sorted({int(w) for w in win.ravel()})
    index = {a: i for i, a in enumerate(used)}
    z = [[index[int(w)] for w in row] for row in win]
    xs, ys = [size_label(s) for s in regions.sizes], [str(p) for p in regions.ps]
    text = []
    for i, _ in enumerate(regions.ps):
        row = []
        for j, _ in enumerate(regions.sizes):
            t = sorted(regions.times[:, i, j])
            ratio = t[1] / t[0] if len(t) > 1 and t[0] > 0 else 1.0
            row.append(f"{regions.algorithms[win[i, j]]}: {t[0] * 1e6:.3g} µs (runner-up "
                       f"x{ratio:.2f})")
        text.append(row)
    n = max(len(used), 1)
    scale = []
    for i in range(len(used)):
        color = PALETTE[used[i] % len(PALETTE)]
        scale += [[i / n, color], [(i + 1) / n, color]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=xs,
            y=ys,
            text=text,
            hoverinfo="text",
            zmin=-0.5,
            zmax=n - 0.5,
            colorscale=scale or "Greys",
            colorbar={
                "tickvals": list(range(n)),
                "ticktext": [regions.algorithms[a] for a in used],
                "title": "cheapest",
            },
        )
    )
    fig.update_layout(title=f"cheapest all-reduce per region on {regions.topology.name}",
                      xaxis_title="message size", yaxis_title="world size p (log)", height=480)
    return fig


def regions_rows(regions: Regions) -> list[dict[str, str]]:
    """The same map as table rows: one per p, a column per message size."""
    win = regions.winner
    names = [size_label(s) for s in regions.sizes]
    return [{"p": str(p), **{n: regions.algorithms[w] for n, w in zip(names, win[i])}}
            for i, p in enumerate(regions.ps)]
