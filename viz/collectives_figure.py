"""The Collectives page's picture: a rank x chunk grid per round, animated in the browser.

    from dplab.viz.collectives import CollectiveConfig, walkthrough
    from dplab.viz.collectives_figure import figure
    fig = figure(walkthrough(CollectiveConfig("allreduce", "tree", world_size=6)), start=2)
    fig.show()    # or st.plotly_chart(fig)

One plotly frame per ``Frame`` of the walkthrough (rounds + 1): a heatmap whose cell colour is
how many ranks' contributions the cell holds and whose label says which (the simulator's
provenance), the cell's real values on hover, and one arrow per transfer of the round about to
run (src -> dst in the chunk's column; orange adds, blue copies). The slider and the Play button
run client-side: no server rerun per frame. Each arrow's ``name`` is ``"src>dst:chunk:op"``, so a
test can read the transfers back (``arrows``).
"""

from __future__ import annotations

import functools

import numpy as np
import plotly.colors
import plotly.graph_objects as go

from dplab.reference.schedule import Transfer, chunk_bounds
from dplab.viz.collectives import COLLECTIVES, MAX_VALUES_N, Frame, Walkthrough, contributors_label

__all__ = ["figure", "figure_spec", "at_frame", "arrows", "frame_title", "OP_COLOURS", "PLAY_MS",
           "BUTTONS_PX"]

OP_COLOURS = {"reduce": "#e4572e", "copy": "#2e86ab"}
# Spelled out: plotly.py resolves a named scale in frames, plotly.js in the first view, and their
# "Blues" run opposite ways (the colours flipped when Play started).
BLUES = [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Blues)]
PLAY_MS = 700  # one round per 0.7 s: the p=16 ring's 30 rounds take 21 s
BUTTONS_PX = 140  # Play and Pause, side by side (about 115 px in Chromium), and a gap


def frame_title(w: Walkthrough, f: Frame) -> str:
    """The counters of a frame, shown above the grid (so Play shows them too)."""
    cfg = w.config
    head = (
        f"round {f.index + 1} of {w.rounds}: {f.phase}"
        if f.transfers
        else f"end ({w.rounds} rounds)"
    )
    busiest = max(f.bytes_sent) if f.bytes_sent else 0
    form = "none" if w.closed_form_bytes is None else f"{w.closed_form_bytes:,}"
    return (f"{cfg.algorithm} {COLLECTIVES[cfg.collective]}, p={cfg.world_size} · {head}<br>"
            f"<sup>bytes sent, busiest rank: {busiest:,} (closed form, whole collective: "
            f"{form}) · cost model so far: {f.time_s * 1e6:,.2f} µs</sup>")


@functools.lru_cache(maxsize=1 << 14)
def _label(counts: bytes, dtype: str) -> str:
    """``contributors_label`` of a cell's counts, worked out once: most cells of a frame hold what
    they held a frame before, and a pipelined schedule has rounds x ranks x chunks of them."""
    return contributors_label(np.frombuffer(counts, dtype=dtype))


def _cells(w: Walkthrough, f: Frame) -> tuple[np.ndarray, list[list[str]], list[list[str]]]:
    """z (distinct contributors), the labels, and the hover text of every [rank][chunk] cell."""
    p, k = w.config.world_size, w.schedule.num_chunks
    bounds = chunk_bounds(w.config.n, k)
    z = (f.holdings > 0).sum(axis=2)
    labels, hover = [], []
    for r in range(p):
        row_labels, row_hover = [], []
        for c in range(k):
            label = _label(f.holdings[r, c].tobytes(), f.holdings.dtype.str)
            row_labels.append(label + (" ✓" if f.done[r, c] else ""))
            a, b = bounds[c]
            if f.values is None:
                values = f"(shown for vectors of up to {MAX_VALUES_N} elements)"
            else:
                values = "[" + ", ".join(f"{v:g}" for v in f.values[r][a:b]) + "]"
            row_hover.append(f"rank {r}, chunk {c} (elements {a}..{b - 1 if b > a else a})<br>"
                             f"holds contributions of ranks {label}<br>values {values}")
        labels.append(row_labels)
        hover.append(row_hover)
    return z, labels, hover


def _arrows(transfers: tuple[Transfer, ...]) -> list[dict]:
    """One annotation per transfer, inside the chunk's column; several into one column fan out."""
    per_chunk: dict[int, list[Transfer]] = {}
    for t in transfers:
        per_chunk.setdefault(t.chunk, []).append(t)
    out = []
    for chunk, ts in per_chunk.items():
        step = min(0.18, 0.7 / len(ts))
        for i, t in enumerate(ts):
            x = chunk + (i - (len(ts) - 1) / 2) * step
            out.append(dict(x=x, y=t.dst, ax=x, ay=t.src, xref="x", yref="y", axref="x", ayref="y",
                            showarrow=True, arrowhead=2, arrowsize=1.2, arrowwidth=2,
                            arrowcolor=OP_COLOURS[t.op], standoff=6, startstandoff=6, text="",
                            name=f"{t.src}>{t.dst}:{t.chunk}:{t.op}",
                            hovertext=f"rank {t.src} → rank {t.dst}: chunk {t.chunk}, "
                                      f"{'add' if t.op == 'reduce' else 'copy'}"))
    return out


def arrows(layout: dict | go.Layout) -> list[Transfer]:
    """The transfers a frame's arrows draw, read back from their names."""
    annotations = layout.get("annotations", ()) if isinstance(layout, dict) else layout.annotations
    found = []
    for a in annotations:
        name = a["name"] if isinstance(a, dict) else a.name
        if name and ">" in name:
            route, chunk, op = name.split(":")
            src, dst = route.split(">")
            found.append(Transfer(int(src), int(dst), int(chunk), op))
    return found


def _heatmap(w: Walkthrough, f: Frame) -> dict:
    z, labels, hover = _cells(w, f)
    p = w.config.world_size
    return dict(type="heatmap", z=z.tolist(), text=labels, customdata=hover, texttemplate="%{text}",
                hovertemplate="%{customdata}<extra></extra>", zmin=0, zmax=max(p, 1),
                colorscale=BLUES, colorbar=dict(title=dict(text="ranks held"), thickness=12),
                x=list(range(w.schedule.num_chunks)), y=list(range(p)), xgap=2, ygap=2)


def figure_spec(w: Walkthrough) -> dict:
    """The whole animation as a plotly dict (every frame), showing frame 0: what a page caches."""
    frames = [
        dict(
            name=str(f.index),
            data=[_heatmap(w, f)],
            layout=dict(annotations=_arrows(f.transfers), title=dict(text=frame_title(w, f))),
        )
        for f in w.frames
    ]
    p, k = w.config.world_size, w.schedule.num_chunks
    steps = [dict(method="animate", label=str(f.index),
                  args=[[str(f.index)], dict(mode="immediate", frame=dict(duration=0, redraw=True),
                                             transition=dict(duration=0))]) for f in w.frames]
    layout = dict(
        title=dict(text=frame_title(w, w.frames[0]), x=0.0, xanchor="left", font=dict(size=14)),
        annotations=_arrows(w.frames[0].transfers),
        height=max(320, 30 * p + 200),
        margin=dict(l=60, r=20, t=80, b=110),
        xaxis=dict(
            title=dict(text="chunk"),
            tickmode="array",
            tickvals=list(range(k)),
            range=[-0.5, k - 0.5],
        ),
        yaxis=dict(
            title=dict(text="rank"), tickmode="array", tickvals=list(range(p)), autorange="reversed"
        ),
        # One row under the axis: the buttons at its left, the slider's rail starting BUTTONS_PX to
        # their right (pixels, so a half-width panel keeps them apart too) and its "frame N" label
        # at the rail's right end, where no button can cover it.
        sliders=[
            dict(
                active=0,
                steps=steps,
                x=0.0,
                len=1.0,
                y=-0.08,
                pad=dict(t=30, l=BUTTONS_PX),
                currentvalue=dict(prefix="frame ", xanchor="right", font=dict(size=12)),
            )
        ],
        updatemenus=[
            dict(
                type="buttons",
                direction="left",
                x=0.0,
                y=-0.08,
                xanchor="left",
                yanchor="top",
                pad=dict(t=30, r=0),
                showactive=False,
                buttons=[
                    dict(
                        label="▶ Play",
                        method="animate",
                        args=[
                            None,
                            dict(
                                frame=dict(duration=PLAY_MS, redraw=True),
                                fromcurrent=True,
                                transition=dict(duration=0),
                                mode="immediate",
                            ),
                        ],
                    ),
                    dict(
                        label="Pause",
                        method="animate",
                        args=[
                            [None],
                            dict(
                                frame=dict(duration=0, redraw=False),
                                mode="immediate",
                                transition=dict(duration=0),
                            ),
                        ],
                    ),
                ],
            )
        ],
    )
    return dict(data=frames[0]["data"], layout=layout, frames=frames)


def at_frame(spec: dict, start: int) -> go.Figure:
    """``spec`` showing frame ``start`` (clamped), slider set there; Play goes on from it. Cheap:
    the frames are shared, only the shown data, arrows, title and slider change."""
    frames = spec["frames"]
    start = max(0, min(start, len(frames) - 1))
    shown = frames[start]
    layout = dict(spec["layout"], annotations=shown["layout"]["annotations"],
                  title=dict(spec["layout"]["title"], text=shown["layout"]["title"]["text"]),
                  sliders=[dict(spec["layout"]["sliders"][0], active=start)])
    # Not re-validated: plotly's per-property checks took 2.6 s of a 4 s build for the p=16 ring
    # (31 frames); the tests validate whole figures instead.
    return go.Figure(dict(data=shown["data"], layout=layout, frames=frames), _validate=False)


def figure(w: Walkthrough, start: int = 0) -> go.Figure:
    """The animated grid, showing frame ``start`` until the slider or Play moves it."""
    return at_frame(figure_spec(w), start)
