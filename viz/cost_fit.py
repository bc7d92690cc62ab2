"""Measured all-reduce times against the model: bench rows, a least-squares alpha/beta, residuals.

A bench row (``dplab bench --json``) is one algorithm's time for one buffer at one world size.
Its schedule says how many latencies and how many bytes lie on the critical path
(``dplab.viz.cost.features``), so every row is one linear equation

    time = a(algorithm, p, n) * alpha + b(algorithm, p, n) * beta

and alpha, beta per backend (or per backend and algorithm) are a least-squares solution.
The reduction's gamma is not fitted on its own: every algorithm here adds half the bytes it
moves (b = 2 x bytes reduced), so gamma hides inside the fitted beta as gamma / 2.

    from dplab.viz.cost_fit import run_bench, fit_alpha_beta
    rows = run_bench([2], [4096, 1 << 16, 1 << 20])   # the same path as `dplab bench`
    for f in fit_alpha_beta(rows): print(f.backend, f.alpha_s, f.beta_gbps)

``native`` (the engine's own all-reduce) and ``memcpy`` rows have no schedule of ours and are
not fitted; they stay on the page's figure as measured points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from dplab.reference.algorithms import ALLREDUCE
from dplab.reference.errors import ConfigError
from dplab.viz.cost import COLORS, features, format_bytes

__all__ = ["BENCH_KEYS", "Fit", "load_bench_json", "fittable", "fit_alpha_beta", "fit_table",
           "residual_rows", "residual_figure", "run_bench"]

BENCH_KEYS = ("backend", "algorithm", "world_size", "bytes", "time_us")


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

    @property
    def beta_gbps(self) -> float | None:
        return None if not self.beta else 1e-9 / self.beta

    def predict_s(self, row: dict[str, Any], itemsize: int = 4) -> float:
        a, b = features(row["algorithm"], row["world_size"], row["bytes"], itemsize)
        return a * (self.alpha_s or 0.0) + b * (self.beta or 0.0)


def load_bench_json(text: str | bytes, name: str = "bench JSON") -> list[dict[str, Any]]:
    """Rows from what ``dplab bench --json`` writes ({"meta", "rows"}), or a bare list of rows."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name} is not JSON ({e}): give a file written by `dplab bench --json`") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if isinstance(data, dict) and data.get("meta", {}).get("command", "bench") != "bench":
        raise ConfigError(f"{name} holds `dplab {data['meta']['command']}` rows: "
                          "give `dplab bench --json` output")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{name} has no list of rows: give a file written by `dplab bench --json`")
    for i, r in enumerate(rows):
        missing = [k for k in BENCH_KEYS if k not in r]
        if missing:
            raise ConfigError(f"{name}: row {i} lacks {', '.join(missing)}: give `dplab bench --json` output")
    return rows


def fittable(row: dict[str, Any]) -> bool:
    """Rows with a schedule of ours, more than one rank and a positive time."""
    return row["algorithm"] in ALLREDUCE and row["world_size"] > 1 and row["time_us"] > 0


def fit_alpha_beta(rows: list[dict[str, Any]], per_algorithm: bool = False, relative: bool = True,
                   itemsize: int = 4) -> list[Fit]:
    """Least-squares alpha and beta per backend (or per backend and algorithm).

    ``relative`` (the default) minimises the relative error of every row, so a 4 KiB row, which
    is nearly all alpha, counts as much as a 64 MiB row, which is nearly all beta; plain least
    squares (``relative=False``) lets the largest times decide alpha too, and its alpha is noise.
    Exact points (times that are the model's own) are recovered to rounding either way.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if fittable(r):
            groups.setdefault((r["backend"], r["algorithm"] if per_algorithm else "all"), []).append(r)
    fits = []
    for (backend, alg), mine in sorted(groups.items()):
        mine = sorted(mine, key=lambda r: (r["algorithm"], r["world_size"], r["bytes"]))
        x = np.array([features(r["algorithm"], r["world_size"], r["bytes"], itemsize) for r in mine])
        t = np.array([r["time_us"] * 1e-6 for r in mine])
        w = 1.0 / t if relative else np.ones_like(t)
        scale = np.abs(x).max(axis=0)  # alpha counts ~10, beta bytes ~1e7: columns of one size
        design = x * w[:, None] / scale
        if len(mine) < 2 or np.linalg.matrix_rank(design) < 2:
            fits.append(Fit(backend, alg, None, None, tuple(mine),
                            "needs rows of at least two sizes to fit both alpha and beta"))
            continue
        coef = np.linalg.lstsq(design, t * w, rcond=None)[0] / scale
        note = "" if (coef > 0).all() else "a negative value: these rows do not follow time = a·α + b·β"
        fits.append(Fit(backend, alg, float(coef[0]), float(coef[1]), tuple(mine), note))
    return fits


def residual_rows(fit: Fit, itemsize: int = 4) -> list[dict[str, Any]]:
    """Per row: measured and fitted µs, their difference and its share of the measurement."""
    out = []
    for r in fit.rows:
        model = fit.predict_s(r, itemsize) * 1e6 if fit.alpha_s is not None else None
        res = None if model is None else r["time_us"] - model
        out.append({"backend": r["backend"], "algorithm": r["algorithm"], "world_size": r["world_size"],
                    "bytes": r["bytes"], "size": format_bytes(r["bytes"]), "measured_us": r["time_us"],
                    "fitted_us": model, "residual_us": res,
                    "residual_pct": None if res is None else 100 * res / r["time_us"]})
    return out


def fit_table(fits: list[Fit], itemsize: int = 4) -> list[dict[str, Any]]:
    """One row per fit: alpha in µs, beta as GB/s, and how well the line fits its rows."""
    table = []
    for f in fits:
        pct = [abs(r["residual_pct"]) for r in residual_rows(f, itemsize) if r["residual_pct"] is not None]
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
    fig.update_layout(title="Residuals: (measured - fitted) / measured",
                      xaxis={"title": "message size (bytes)", "type": "log"},
                      yaxis={"title": "residual (%)"}, legend={"orientation": "h"}, margin={"t": 50, "b": 10})
    return fig


def run_bench(world_sizes: list[int], sizes: list[int],
              algorithms: tuple[str, ...] = ("ring", "tree", "naive", "native"), backend: str = "local",
              reps: int = 3, target_seconds: float = 0.05, warmup: int = 2) -> list[dict[str, Any]]:
    """A short ``dplab bench`` now, through the command line's own parser, checks and runner."""
    from dplab.backends.cli.args import build_parser
    from dplab.backends.cli.checks import check_args
    from dplab.backends.cli.commands import cmd_bench

    argv = ["bench", "--backends", backend, "--world-sizes", ",".join(map(str, world_sizes)),
            "--sizes", ",".join(map(str, sizes)), "--algorithms", ",".join(algorithms),
            "--reps", str(reps), "--target-seconds", str(target_seconds), "--warmup", str(warmup)]
    args = build_parser().parse_args(argv)
    check_args(args)
    return cmd_bench(args)
