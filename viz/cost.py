"""The alpha-beta-gamma model as curves: one per algorithm, and where they cross.

Every number here is ``dplab.reference.costmodel.cost`` over the same schedule the executor
runs (``allreduce_schedule``): nothing is a closed form typed in twice. A crossover is where
two algorithms' times change order; it is found on the curve's size grid and then pinned
down to a whole element by bisection on the cost model itself, so "tree beats ring below
91.9 KiB at p=8" is the model's answer, not a reading of the plot.

    from dplab.viz.cost import CostParams, crossovers, cost_figure
    params = CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8)
    [c.sentence() for c in crossovers(params)]   # [..., 'tree beats ring below 91.9 KiB at p=8']
    [m.sentence() for m in merged_crossovers(params)]  # ['tree beats ring and direct below 91.9 KiB at p=8']
    cost_figure(params).show()

Algorithms whose curves tie at every size (ring and direct cost the same on paper) are
``coinciding``: the figure dashes all but the first of them so the first stays visible, and
their crossovers with a third algorithm are one marker and one sentence (``merged_crossovers``).

The page (``viz/pages/cost.py``) only wires controls to these functions; the measured side
(bench rows, the alpha/beta fit) is ``dplab.viz.cost_fit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import plotly.graph_objects as go

from dplab.backends.cli.bench import busbw_factor
from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError

__all__ = ["CostParams", "Crossover", "MergedCrossover", "COLORS", "Y_AXES", "DASHES", "size_grid",
           "model_time", "curves", "crossovers", "coinciding", "coinciding_sentence", "merged_crossovers",
           "features", "tie_tolerance", "tolerant_sign", "to_y", "format_bytes",
           "busbw_line", "cost_figure"]

COLORS = {"naive": "#7f7f7f", "ring": "#1f77b4", "tree": "#2ca02c", "direct": "#ff7f0e",
          "native": "#9467bd"}
DASHES = ("solid", "dash", "dot", "dashdot")  # the n-th member of a coinciding group
Y_AXES = {"time": "time per all-reduce (µs)", "algbw": "algbw (GB/s)", "busbw": "busbw (GB/s)"}


@dataclass(frozen=True)
class CostParams:
    """The model's knobs as a person sets them: alpha in seconds, beta and gamma as GB/s.

    ``gamma_gbps`` is the reduction's throughput (bytes added per second / 1e9); None leaves the
    reduction free, as the Hockney alpha-beta model does.
    """

    alpha_s: float = 5e-6
    beta_gbps: float = 10.0
    gamma_gbps: float | None = None
    world_size: int = 8
    min_bytes: int = 1 << 10
    max_bytes: int = 256 << 20
    itemsize: int = 4
    algorithms: tuple[str, ...] = field(default_factory=lambda: tuple(ALLREDUCE))

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.beta_gbps > 0):
            raise ConfigError(f"alpha must be >= 0 s and beta > 0 GB/s, got {self.alpha_s}, {self.beta_gbps}")
        if self.gamma_gbps is not None and self.gamma_gbps <= 0:
            raise ConfigError(f"gamma must be > 0 GB/s (or None: reduction free), got {self.gamma_gbps}")
        if self.world_size < 2:
            raise ConfigError(f"world size must be >= 2 (one rank has nothing to reduce), "
                              f"got {self.world_size}")
        if not self.itemsize <= self.min_bytes < self.max_bytes:
            raise ConfigError(f"message sizes must satisfy itemsize <= min < max, got "
                              f"{self.min_bytes}..{self.max_bytes} bytes (itemsize {self.itemsize})")
        unknown = [a for a in self.algorithms if a not in ALLREDUCE]
        if unknown:
            raise ConfigError(f"no cost model for {', '.join(unknown)}: choose from {', '.join(ALLREDUCE)}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.beta_gbps * 1e9)

    @property
    def gamma(self) -> float:
        return 0.0 if self.gamma_gbps is None else 1.0 / (self.gamma_gbps * 1e9)


@dataclass(frozen=True)
class Crossover:
    """Below ``nbytes`` (exclusive) ``faster_below`` is the faster of the pair; from it on, the other."""

    faster_below: str
    faster_above: str
    nbytes: int
    world_size: int

    def sentence(self) -> str:
        return f"{self.faster_below} beats {self.faster_above} below {format_bytes(self.nbytes)} " \
               f"at p={self.world_size}"


def _and(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclass(frozen=True)
class MergedCrossover:
    """Crossovers at one size whose algorithms coincide: one marker, one sentence.

    ``faster_below`` beat(s) every one of ``faster_above`` below ``nbytes`` (the smallest of the
    merged crossovers' sizes); ``parts`` are the pairwise crossovers it stands for.
    """

    faster_below: tuple[str, ...]
    faster_above: tuple[str, ...]
    nbytes: int
    world_size: int
    parts: tuple[Crossover, ...]

    def sentence(self) -> str:
        verb = "beats" if len(self.faster_below) == 1 else "beat"
        return f"{_and(self.faster_below)} {verb} {_and(self.faster_above)} below " \
               f"{format_bytes(self.nbytes)} at p={self.world_size}"

    def label(self) -> str:
        """The marker's text: winners below | winners above, coinciding ones joined by '='."""
        return f"{'='.join(self.faster_below)}|{'='.join(self.faster_above)}"


def size_grid(params: CostParams, points: int = 97) -> list[int]:
    """Log-spaced message sizes, whole elements, both ends included."""
    lo, hi = params.min_bytes // params.itemsize, params.max_bytes // params.itemsize
    elems = np.unique(np.round(np.geomspace(lo, hi, points)).astype(np.int64))
    return [int(e) * params.itemsize for e in elems]


def model_time(algorithm: str, nbytes: int, params: CostParams) -> float:
    """Seconds for one all-reduce of ``nbytes``: the cost model over the executor's schedule."""
    s = allreduce_schedule(algorithm, params.world_size)
    return cost(s, nbytes, params.alpha_s, params.beta, params.gamma, params.itemsize).time


def curves(params: CostParams, points: int = 97) -> dict[str, tuple[list[int], list[float]]]:
    """Per algorithm: (sizes in bytes, seconds)."""
    sizes = size_grid(params, points)
    return {a: (sizes, [model_time(a, n, params) for n in sizes]) for a in params.algorithms}


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def tie_tolerance(a: str, b: str, params: CostParams) -> float:
    """Seconds below which two algorithms' times are a tie, not an order.

    Chunks hold whole elements, so each message of a schedule can be one element longer than
    n/k: two algorithms that cost the same on paper (ring and direct) differ by up to one
    element per message, and which one is ahead flips with n mod p. Such flips are rounding,
    not crossovers: a tie is within one element per message of both schedules.
    """
    p, isz = params.world_size, params.itemsize
    messages = features(a, p, isz)[0] + features(b, p, isz)[0]
    return messages * isz * (params.beta + params.gamma)


def tolerant_sign(a: str, b: str, nbytes: int, params: CostParams) -> int:
    """-1: a is faster, 1: b is faster, 0: a tie (within ``tie_tolerance``)."""
    d = model_time(a, nbytes, params) - model_time(b, nbytes, params)
    return 0 if abs(d) <= tie_tolerance(a, b, params) else _sign(d)


def crossovers(params: CostParams, points: int = 97) -> list[Crossover]:
    """Every size where two algorithms change order, to the element, smallest first.

    The grid finds the brackets: a size where one algorithm is clearly faster (by more than
    ``tie_tolerance``) and a later one where the other is. Bisection on whole elements then
    finds, inside, a size n where the exact order changes: the earlier algorithm is ahead (or
    tied) just below n, the other ahead at n. The chunks' whole elements make the difference of
    two curves a fine sawtooth, so within about one element per chunk of n the exact order may
    flip more than once: the bisection reports one of those flips, the crossover to any
    precision a sentence needs.
    """
    sizes = size_grid(params, points)
    out = []
    for a, b in combinations(params.algorithms, 2):
        def diff(n: int, a: str = a, b: str = b) -> float:
            return model_time(a, n, params) - model_time(b, n, params)
        tol = tie_tolerance(a, b, params)
        signs = [0 if abs(d) <= tol else _sign(d) for d in map(diff, sizes)]
        last_i = None
        for i, si in enumerate(signs):
            if si == 0:
                continue
            if last_i is not None and si != signs[last_i]:
                n = _bisect(diff, sizes[last_i], sizes[i], signs[last_i], params.itemsize)
                below, above = (a, b) if signs[last_i] < 0 else (b, a)
                out.append(Crossover(below, above, n, params.world_size))
            last_i = i
    return sorted(out, key=lambda x: (x.nbytes, x.faster_below, x.faster_above))


def coinciding(params: CostParams, points: int = 97) -> list[tuple[str, ...]]:
    """Groups of two or more algorithms whose curves tie (``tolerant_sign`` 0) at every grid size.

    Ring and direct cost the same on paper at every p (2(p-1) latencies, 2(p-1)/p·n bytes), so
    their curves lie on each other; at p=2 tree and naive do too. Groups keep
    ``params.algorithms``' order; each member ties with the group's first.
    """
    sizes = size_grid(params, points)
    groups: list[list[str]] = []
    for a in params.algorithms:
        home = next((g for g in groups if all(tolerant_sign(g[0], a, n, params) == 0 for n in sizes)), None)
        if home is None:
            groups.append([a])
        else:
            home.append(a)
    return [tuple(g) for g in groups if len(g) > 1]


def coinciding_sentence(groups: list[tuple[str, ...]], world_size: int) -> str | None:
    """One caption for all coinciding curves, or None when every curve stands alone."""
    if not groups:
        return None
    parts = [f"{_and(g)} cost the same at every size" for g in groups]
    dashed = [a for g in groups for a in g[1:]]
    return (f"{'; '.join(parts)} at p={world_size} (within one element per message), so their curves "
            f"coincide: {_and(tuple(dashed))} {'is' if len(dashed) == 1 else 'are'} drawn dashed over "
            f"{_and(tuple(g[0] for g in groups))}.")


def merged_crossovers(params: CostParams, points: int = 97,
                      xs: list[Crossover] | None = None) -> list[MergedCrossover]:
    """``crossovers`` with those of coinciding algorithms merged: "tree beats ring and direct below ...".

    Two crossovers merge when their winners below are the same or coincide, their winners above
    are the same or coincide, and their sizes are within 1% (one spot on the log axis); the
    merged size is the smallest. ``xs``: crossovers already computed for these params.
    """
    xs = crossovers(params, points) if xs is None else xs
    group_of = {a: g for g in coinciding(params, points) for a in g}
    buckets: dict[tuple[tuple[str, ...], tuple[str, ...]], list[list[Crossover]]] = {}
    for x in xs:  # smallest first
        key = (group_of.get(x.faster_below, (x.faster_below,)),
               group_of.get(x.faster_above, (x.faster_above,)))
        clusters = buckets.setdefault(key, [])
        if clusters and x.nbytes <= clusters[-1][0].nbytes * 1.01:
            clusters[-1].append(x)
        else:
            clusters.append([x])
    out = []
    for (gb, ga), clusters in buckets.items():
        for cl in clusters:
            below = tuple(a for a in gb if any(x.faster_below == a for x in cl))
            above = tuple(a for a in ga if any(x.faster_above == a for x in cl))
            out.append(MergedCrossover(below, above, min(x.nbytes for x in cl), params.world_size, tuple(cl)))
    return sorted(out, key=lambda m: (m.nbytes, m.faster_below, m.faster_above))


def _bisect(diff: Any, lo: int, hi: int, left_sign: int, itemsize: int) -> int:
    """Shrink [lo, hi] to one element: diff(lo) has ``left_sign`` (or is 0), diff(hi) not; returns hi."""
    while hi - lo > itemsize:
        mid = lo + (hi - lo) // itemsize // 2 * itemsize
        if _sign(diff(mid)) in (left_sign, 0):
            lo = mid
        else:
            hi = mid
    return hi


def to_y(nbytes: Any, seconds: Any, world_size: int, y: str) -> np.ndarray:
    """Seconds as the chosen axis: µs, algbw = bytes/time, busbw = algbw * 2(p-1)/p (GB/s)."""
    n, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if y == "time":
        return t * 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(t > 0, n / t / 1e9, np.nan)
    if y == "algbw":
        return algbw
    if y == "busbw":
        return algbw * busbw_factor(world_size)
    raise ConfigError(f"y axis must be one of {', '.join(Y_AXES)}, got {y!r}")


def busbw_line(world_size: int) -> str:
    """The one line that explains busbw."""
    f = busbw_factor(world_size)
    return (f"busbw = algbw × 2(p-1)/p = algbw × {f:.3g} at p={world_size}: an all-reduce moves "
            f"2(p-1)/p of the buffer through every rank's link (ring), so busbw is comparable "
            f"across world sizes and with the link's own bandwidth 1/β.")


def format_bytes(n: float) -> str:
    """1024 -> '1 KiB', 94120 -> '91.9 KiB': binary units, three significant digits."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == round(v) else f"{v:.3g} {unit}"
    return f"{int(n)} B"


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
        fig.add_trace(go.Scatter(x=n, y=to_y(n, t, p, y).tolist(), mode="markers+text",
                                 name="crossovers", marker={"symbol": "x", "size": 11, "color": "black"},
                                 text=[x.label() for x in xs],
                                 textposition="top center", hovertext=[x.sentence() for x in xs],
                                 hoverinfo="text"))
    symbols = ["circle", "square", "diamond", "triangle-up", "cross"]
    rows = [r for r in measured or [] if r.get("world_size") == p and r.get("algorithm") != "memcpy"]
    backends = sorted({r["backend"] for r in rows})
    for (backend, alg) in sorted({(r["backend"], r["algorithm"]) for r in rows}):
        mine = sorted((r for r in rows if (r["backend"], r["algorithm"]) == (backend, alg)),
                      key=lambda r: r["bytes"])
        n = [r["bytes"] for r in mine]
        t = [r["time_us"] * 1e-6 for r in mine]
        fig.add_trace(go.Scatter(x=n, y=to_y(n, t, p, y).tolist(), mode="markers",
                                 name=f"{alg} ({backend}, measured)", legendgroup=alg,
                                 marker={"color": COLORS.get(alg, "black"), "size": 9,
                                         "symbol": symbols[backends.index(backend) % len(symbols)]}))
        if fitted and (backend, alg) in fitted and alg in ALLREDUCE:
            al, be = fitted[(backend, alg)]
            ft = [al * fa + be * fb for fa, fb in (features(alg, p, k, params.itemsize) for k in n)]
            fig.add_trace(go.Scatter(x=n, y=to_y(n, ft, p, y).tolist(), mode="lines",
                                     name=f"{alg} ({backend}, fitted)", legendgroup=alg,
                                     line={"color": COLORS[alg], "dash": "dash"}))
    fig.update_layout(title=f"All-reduce at p={p}: α={params.alpha_s * 1e6:.3g} µs, "
                            f"β={params.beta_gbps:g} GB/s, "
                            f"γ={'free' if params.gamma_gbps is None else f'{params.gamma_gbps:g} GB/s'}",
                      xaxis={"title": "message size (bytes)", "type": "log"},
                      yaxis={"title": Y_AXES[y], "type": "log"},
                      # above the plot, under the title: below it, it covered the x axis' title
                      legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"},
                      margin={"t": 90, "b": 10})
    return fig


def features(algorithm: str, world_size: int, nbytes: int, itemsize: int = 4) -> tuple[float, float]:
    """(latency terms, bytes on the critical path) of one all-reduce, read off its schedule.

    The cost model is linear in alpha and beta (for these schedules the slowest rank of a round is
    the same whichever term dominates; ``tests/test_viz_cost_model.py`` checks it), so
    ``time = a * alpha + b * beta`` with a = cost at (1, 0, 0) and b = cost at (0, 1, 0).
    a is the rounds for ring and tree and 2(p-1) for naive and direct (p-1 messages queue at one
    port); b is 2(p-1)/p · n for ring and direct, 2⌈lg p⌉·n for tree, 2(p-1)·n for naive.
    """
    s = allreduce_schedule(algorithm, world_size)
    return (cost(s, nbytes, 1.0, 0.0, 0.0, itemsize).time, cost(s, nbytes, 0.0, 1.0, 0.0, itemsize).time)
