"""Measured all-reduce times against the model: bench rows, a least-squares alpha/beta, residuals.

    from dplab.viz.cost_fit import run_bench, fit_alpha_beta
    rows = run_bench([2], [4096, 1 << 16, 1 << 20])   # the same path as `dplab bench`
    for f in fit_alpha_beta(rows): print(f.backend, f.alpha_s, f.beta_gbps)

Each bench row is one linear equation, its terms from the schedule's critical path
(``dplab.reference.costfit.terms``), solved by least squares per backend (or backend and
algorithm), as ``dplab tune`` does:

    time = a(algorithm, p, n) * alpha + b(algorithm, p, n) * beta

gamma is folded into beta (as gamma / 2: these algorithms add half the bytes they move).
``native`` and ``memcpy`` rows have no schedule of ours: not fitted, drawn as measured points.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go

from dplab.backends.bench.spec import BenchSpec
from dplab.backends.launch.world import World
from dplab.reference import costfit
from dplab.reference.costfit import BENCH_KEYS, CostFit, load_bench_json
from dplab.viz.cost import COLORS, format_bytes

__all__ = ["BENCH_KEYS", "Fit", "load_bench_json", "fittable", "fit_alpha_beta", "fit_table",
           "residual_rows", "residual_figure", "run_bench"]


@dataclass(frozen=True)
class Fit:
    """alpha (s) and beta (s/byte) of one group of rows, with each row's residual.

    ``algorithm`` is "all" when the group is a whole backend. ``alpha_s`` and ``beta`` are None
    when the rows cannot pin two unknowns down (``note`` says why).
    """

    backend: str
    algorithm: str
    alpha_s: float | None
    beta: float | None
    rows: tuple[dict[str, Any], ...]
    note: str = ""
    core: CostFit | None = field(default=None, compare=False, repr=False)  # reference.costfit's fit

    @property
    def beta_gbps(self) -> float | None:
        return None if not self.beta else 1e-9 / self.beta

    def predict_s(self, row: dict[str, Any], itemsize: int = 4) -> float:
        core = self.core or CostFit(
            self.backend, "all", self.algorithm, self.alpha_s, self.beta, None
        )
        return core.predict_s(row["algorithm"], row["world_size"], row["bytes"], itemsize)


def fittable(row: dict[str, Any]) -> bool:
    """Rows with a schedule of ours, more than one rank and a positive time."""
    return costfit.fittable(row, native=False)


def fit_alpha_beta(rows: list[dict[str, Any]], per_algorithm: bool = False, relative: bool = True,
                   itemsize: int = 4) -> list[Fit]:
    """Least-squares alpha and beta per backend (or per backend and algorithm): ``costfit.fit``.

    ``relative`` (the default) minimises the relative error of every row, so a 4 KiB row, which
    is nearly all alpha, counts as much as a 64 MiB row, which is nearly all beta; plain least
    squares (``relative=False``) lets the largest times decide alpha too, and its alpha is noise.
    Exact points (times that are the model's own) are recovered to rounding either way.
    """
    by = ("backend", "algorithm") if per_algorithm else ("backend",)
    return [
        Fit(f.backend, f.algorithm, f.alpha, f.beta, f.rows, f.note, f)
        for f in costfit.fit(
            rows, by, itemsize, relative, gamma=False, native=False, nonnegative=False
        )
    ]


def residual_rows(fit: Fit, itemsize: int = 4) -> list[dict[str, Any]]:
    """Per row: measured and fitted µs, their difference and its share of the measurement."""
    out = []
    for r in fit.rows:
        model = fit.predict_s(r, itemsize) * 1e6 if fit.alpha_s is not None else None
        res = None if model is None else r["time_us"] - model
        out.append(
            {
                "backend": r["backend"],
                "algorithm": r["algorithm"],
                "world_size": r["world_size"],
                "bytes": r["bytes"],
                "size": format_bytes(r["bytes"]),
                "measured_us": r["time_us"],
                "fitted_us": model,
                "residual_us": res,
                "residual_pct": None if res is None else 100 * res / r["time_us"],
            }
        )
    return out


def fit_table(fits: list[Fit], itemsize: int = 4) -> list[dict[str, Any]]:
    """One row per fit: alpha in µs, beta as GB/s, and how well the line fits its rows."""
    table = []
    for f in fits:
        pct = [
            abs(r["residual_pct"])
            for r in residual_rows(f, itemsize)
            if r["residual_pct"] is not None
        ]
        table.append({"backend": f.backend, "algorithm": f.algorithm, "rows": len(f.rows),
                      "alpha_us": None if f.alpha_s is None else f.alpha_s * 1e6,
                      "beta_gbps": f.beta_gbps,
                      "rms_residual_pct": float(np.sqrt(np.mean(np.square(pct)))) if pct else None,
                      "max_residual_pct": max(pct) if pct else None, "note": f.note})
    return table


def residual_figure(fits: list[Fit], itemsize: int = 4) -> go.Figure:
    """Residual (% of the measured time) against message size, one trace per fit and algorithm."""
    fig = go.Figure()
    for f in fits:
        rows = [r for r in residual_rows(f, itemsize) if r["residual_pct"] is not None]
        for alg in sorted({r["algorithm"] for r in rows}):
            mine = [r for r in rows if r["algorithm"] == alg]
            label = f"{f.backend} {alg}" + (" (backend fit)" if f.algorithm == "all" else "")
            fig.add_trace(go.Scatter(
                x=[r["bytes"] for r in mine], y=[r["residual_pct"] for r in mine], mode="markers",
                name=label, marker={"color": COLORS.get(alg, "black"), "size": 9},
                text=[f"p={r['world_size']}: measured {r['measured_us']:.4g} µs, "
                      f"fitted {r['fitted_us']:.4g} µs" for r in mine],
                hovertemplate="%{x:,} B: %{y:.3g}%<br>%{text}<extra></extra>"))
    fig.add_hline(y=0, line={"color": "black", "width": 1})
    fig.update_layout(
        title="Residuals: (measured - fitted) / measured",
        xaxis={"title": "message size (bytes)", "type": "log"},
        yaxis={"title": "residual (%)"},
        legend={"orientation": "h"},
        margin={"t": 50, "b": 10},
    )
    return fig


def run_bench(
    world_sizes: list[int],
    sizes: list[int],
    algorithms: tuple[str, ...] = ("ring", "tree", "naive", "native"),
    backend: str = "local",
    reps: int = 3,
    target_seconds: float = 0.05,
    warmup: int = 2,
    world: Callable[[int, str], AbstractContextManager[Any]] = World,
) -> list[dict[str, Any]]:
    """A short ``dplab bench`` now: the command's own ``BenchSpec``, checked as the command checks
    it, run on one world per world size. ``world(p, backend)``: what starts each world (the app
    passes its budget's, ``viz.budget``)."""
    spec = BenchSpec((backend,), tuple(world_sizes), tuple(sizes), tuple(algorithms), warmup=warmup,
                     target_seconds=target_seconds, reps=reps)
    spec.check()
    return [row for p in spec.world_sizes for row in spec.run(world, backend, p)]
