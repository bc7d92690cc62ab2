"""Fit alpha, beta, gamma to measured all-reduce times: least squares against the cost model.

    from dplab.reference.costfit import fit, load_bench_json
    rows = load_bench_json(open("bench.json").read())
    for f in fit(rows): print(f.summary())                          # one fit per backend
    for f in fit(rows, by=("backend", "world_size")): print(f.summary())

Each bench row (``dplab bench --json``) is linear in the unknowns, time = a alpha + b beta +
c gamma, with (a, b, c) read off ``cost()`` for that row's schedule (``terms``). gamma is told
apart from beta only by rows of schedules that reduce different shares (the fit's ``note`` says
when it folded them); ``native`` rows are fitted on their own, priced as a ring; ``memcpy`` rows
are not fitted.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule, split_name
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError

__all__ = ["BENCH_KEYS", "NATIVE_STANDIN", "REFERENCE_POINT", "CostFit", "terms", "fit", "fittable",
           "load_bench_json"]

BENCH_KEYS = ("backend", "algorithm", "world_size", "bytes", "time_us")
NATIVE_STANDIN = "ring"  # the schedule whose terms price an engine's own all-reduce
# alpha 10 us, 10 GB/s, 20 GB/s: picks each round's slowest rank
REFERENCE_POINT = (10e-6, 1e-10, 5e-11)
_ALL = "all"


@lru_cache(maxsize=8192)
def terms(algorithm: str, world_size: int, nbytes: int, itemsize: int = 4,
          at: tuple[float, float, float] = REFERENCE_POINT) -> tuple[float, float, float]:
    """(messages, bytes, reduced bytes) on the critical path of one all-reduce, read off the cost
    model itself: ``cost()`` is ``a alpha + b beta + c gamma`` with these (a, b, c) wherever each
    round's slowest rank is the one it is at ``at`` (for symmetric schedules: everywhere).

    The model is a sum over rounds of the slowest rank's linear cost, so near ``at`` it is linear
    and (a, b, c) is its slope: one step in each of alpha, beta, gamma, small enough not to change
    any round's slowest rank (a value under 1% of ``REFERENCE_POINT``'s counts as that 1%). The
    counts are whole numbers; rounding removes the float noise.
    ``native`` is priced as a ring (``NATIVE_STANDIN``).

    Args:
        algorithm: a registered all-reduce, or "native".
        world_size: the number of ranks.
        nbytes: the buffer's bytes.
        itemsize: bytes per element.
        at: the (alpha, beta, gamma) point to read the slope at.

    Returns:
        (a, b, c): messages, bytes and reduced bytes.
    """
    s = allreduce_schedule(NATIVE_STANDIN if algorithm == "native" else algorithm, world_size)
    # a step needs a scale
    x = np.maximum(np.asarray(at, float), np.asarray(REFERENCE_POINT) * 1e-2)
    t0 = cost(s, nbytes, *x, itemsize=itemsize).time
    slope = []
    for i in range(3):
        y = x.copy()
        y[i] += x[i] * 2.0**-6
        slope.append(
            float(round((cost(s, nbytes, *y, itemsize=itemsize).time - t0) / (y[i] - x[i])))
        )
    return slope[0], slope[1], slope[2]


@dataclass(frozen=True)
class CostFit:
    """alpha (s), beta and gamma (s/byte) of one group of rows, and the rows themselves.

    ``world_size`` and ``algorithm`` are "all" when the group spans them. ``alpha`` is None when
    the rows cannot pin the unknowns down; ``gamma`` is None when it was folded into beta
    (``note`` says why).

    Args:
        backend: the rows' backend.
        world_size: the rows' world size, or "all".
        algorithm: the rows' algorithm, or "all".
        alpha: seconds per message, or None.
        beta: seconds per byte, or None.
        gamma: seconds per byte reduced, or None.
        rows: the ``dplab bench`` rows fitted.
        note: what the fit could not do, if anything.
    """

    backend: str
    world_size: int | str
    algorithm: str
    alpha: float | None
    beta: float | None
    gamma: float | None
    rows: tuple[dict[str, Any], ...] = ()
    note: str = ""

    def predict_s(self, algorithm: str, world_size: int, nbytes: int, itemsize: int = 4) -> float:
        """The model's time for one all-reduce (seconds).

        Args:
            algorithm: the all-reduce.
            world_size: the number of ranks.
            nbytes: the buffer's bytes.
            itemsize: bytes per element.

        Returns:
            Seconds.
        """
        a, b, c = terms(algorithm, world_size, nbytes, itemsize, self.point())
        return a * (self.alpha or 0.0) + b * (self.beta or 0.0) + c * (self.gamma or 0.0)

    def point(self) -> tuple[float, float, float]:
        """The (alpha, beta, gamma) to read ``terms`` at: the fit's own, or ``REFERENCE_POINT``.

        Returns:
            The point.
        """
        if self.alpha is None or not (self.alpha or self.beta or self.gamma):
            return REFERENCE_POINT
        return (self.alpha, self.beta or 0.0, self.gamma or 0.0)

    def residuals(self, itemsize: int = 4) -> list[dict[str, Any]]:
        """Per row: measured and fitted µs, their difference and its share of the measurement.

        Args:
            itemsize: bytes per element.

        Returns:
            One dict per row.
        """
        out = []
        for r in self.rows:
            model = None if self.alpha is None else 1e6 * self.predict_s(
                r["algorithm"], r["world_size"], r["bytes"], itemsize)
            res = None if model is None else r["time_us"] - model
            out.append(
                {
                    "backend": r["backend"],
                    "algorithm": r["algorithm"],
                    "world_size": r["world_size"],
                    "bytes": r["bytes"],
                    "measured_us": r["time_us"],
                    "fitted_us": model,
                    "residual_us": res,
                    "residual_pct": None if res is None else 100 * res / r["time_us"],
                }
            )
        return out

    def summary(self, itemsize: int = 4) -> dict[str, Any]:
        """One table row: alpha in µs, beta and gamma as GB/s, and how well the model fits its
        rows.

        Args:
            itemsize: bytes per element.

        Returns:
            The row, as a dict.
        """
        pct = [
            abs(r["residual_pct"])
            for r in self.residuals(itemsize)
            if r["residual_pct"] is not None
        ]
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "algorithm": self.algorithm,
            "rows": len(self.rows),
            "alpha_us": None if self.alpha is None else self.alpha * 1e6,
            "beta_gbps": _gbps(self.beta),
            "gamma_gbps": _gbps(self.gamma),
            "rms_residual_pct": float(np.sqrt(np.mean(np.square(pct)))) if pct else None,
            "max_residual_pct": max(pct) if pct else None,
            "note": self.note,
        }

    def to_json(self) -> dict[str, Any]:
        """The fitted values without the rows (what ``dplab tune`` saves).

        Returns:
            A JSON-ready dict.
        """
        return {"backend": self.backend, "world_size": self.world_size, "algorithm": self.algorithm,
                "alpha_s": self.alpha, "beta_s_per_byte": self.beta, "gamma_s_per_byte": self.gamma,
                "rows": len(self.rows), "note": self.note}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostFit:
        """The fit ``to_json`` wrote (without its rows).

        Args:
            d: what ``to_json`` returned.

        Returns:
            The fit.
        """
        return cls(str(d["backend"]), d["world_size"], str(d["algorithm"]), d["alpha_s"],
                   d["beta_s_per_byte"], d["gamma_s_per_byte"], (), str(d.get("note", "")))


def _gbps(per_byte: float | None) -> float | None:
    return None if not per_byte else 1e-9 / per_byte


def fittable(row: dict[str, Any], native: bool = True) -> bool:
    """Rows with a schedule of ours (or ``native``), more than one rank and a positive time.

    Args:
        row: a ``dplab bench`` row.
        native: whether ``native`` rows count.

    Returns:
        True if the row can be fitted.
    """
    alg = row["algorithm"]
    try:
        ours = split_name(alg)[0] in ALLREDUCE
    except ConfigError:
        ours = False
    return (ours or (native and alg == "native")) and row["world_size"] > 1 and row["time_us"] > 0


def fit(rows: list[dict[str, Any]], by: tuple[str, ...] = ("backend",), itemsize: int = 4,
        relative: bool = True, gamma: bool = True, native: bool = True, nonnegative: bool = True
        ) -> list[CostFit]:
    """Least-squares alpha, beta (and gamma) per group of rows; groups by the keys in ``by``
    (backend, world_size, algorithm). ``native`` rows always form groups of their own. A group of
    one algorithm has no gamma of its own (one schedule reduces one fixed share of what it sends).

    ``relative`` (the default) minimises every row's relative error, so a 4 KiB row (nearly all
    alpha) counts as much as a 64 MiB row (nearly all beta); plain least squares lets the largest
    times decide alpha too. No value comes out negative: where the unconstrained solution has one,
    the best fit over the non-negative subsets of the unknowns is taken and ``note`` says so.
    ``nonnegative=False`` keeps the unconstrained solution, negative or not (``note`` says so).
    ``gamma=False`` folds gamma into beta. Exact points (the model's own times) come back exact.

    Args:
        rows: ``dplab bench`` rows.
        by: the keys to group by.
        itemsize: bytes per element.
        relative: minimise relative rather than absolute errors.
        gamma: fit gamma where the group allows it.
        native: fit ``native`` rows too.
        nonnegative: keep every value >= 0.

    Returns:
        One fit per group, in key order.
    """
    groups: dict[tuple[str, Any, str], list[dict[str, Any]]] = {}
    for r in rows:
        if fittable(r, native):
            alg = r["algorithm"] if "algorithm" in by or r["algorithm"] == "native" else _ALL
            key = (r["backend"], r["world_size"] if "world_size" in by else _ALL, alg)
            groups.setdefault(key, []).append(r)
    return [
        _fit_group(
            key,
            sorted(mine, key=lambda r: (r["algorithm"], r["world_size"], r["bytes"])),
            itemsize,
            relative,
            gamma and key[2] == _ALL,
            nonnegative,
        )
        for key, mine in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0])))
    ]


def _fit_group(key: tuple[str, Any, str], rows: list[dict[str, Any]], itemsize: int, relative: bool,
               with_gamma: bool, nonnegative: bool) -> CostFit:
    t = np.array([r["time_us"] * 1e-6 for r in rows])
    w = 1.0 / t if relative else np.ones_like(t)
    point: tuple[float, float, float] = REFERENCE_POINT
    for _ in range(3):  # the slowest rank of a round may depend on the point: refit there
        x = np.array(
            [terms(r["algorithm"], r["world_size"], r["bytes"], itemsize, point) for r in rows]
        )
        coef, has_gamma, note = _solve(x, t, w, with_gamma, nonnegative)
        if coef is None or not coef.any() or tuple(coef) == point:
            break
        point = (float(coef[0]), float(coef[1]), float(coef[2]))
    if coef is None:
        return CostFit(*key, None, None, None, tuple(rows), note)
    return CostFit(*key, float(coef[0]), float(coef[1]), float(coef[2]) if has_gamma else None,
                   tuple(rows), note)


def _solve(x: np.ndarray, t: np.ndarray, w: np.ndarray, with_gamma: bool, nonnegative: bool
           ) -> tuple[np.ndarray | None, bool, str]:
    """Weighted least squares over the identifiable unknowns, none negative (a subset search: there
    are only three). Returns (alpha, beta, gamma), whether gamma was fitted, and a note."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0  # a column of zeros (no reduction at all) is simply not identifiable
    design = x * w[:, None] / scale
    cols, note = ([0, 1, 2] if with_gamma else [0, 1]), ""
    if with_gamma and np.linalg.matrix_rank(design) < 3:
        cols, note = (
            [0, 1],
            "gamma folded into beta: these schedules all reduce one share of what they send",
        )
    if len(t) < 2 or np.linalg.matrix_rank(design[:, cols]) < 2:
        return None, False, "needs rows of at least two sizes to fit both alpha and beta"
    best = None
    for k in range(len(cols), 0 if nonnegative else len(cols) - 1, -1):
        for sub in itertools.combinations(cols, k):
            c = np.linalg.lstsq(design[:, sub], t * w, rcond=None)[0]
            err = float(np.sum((design[:, sub] @ c - t * w) ** 2))
            if ((c >= 0).all() or not nonnegative) and (best is None or err < best[0]):
                best = (err, sub, c)
    if best is None:
        return None, False, "no non-negative alpha and beta fit these rows"
    coef = np.zeros(3)
    coef[list(best[1])] = best[2] / scale[list(best[1])]
    if (coef < 0).any():
        note += "; " if note else ""
        note += "a negative value: these rows do not follow time = a·α + b·β"
    if len(best[1]) < len(cols):
        dropped = " and ".join(("alpha", "beta", "gamma")[i] for i in cols if i not in best[1])
        note += "; " if note else ""
        note += f"{dropped} set to 0: the best fit wanted a negative value"
    return coef, len(cols) == 3, note


def load_bench_json(text: str | bytes, name: str = "bench JSON") -> list[dict[str, Any]]:
    """Rows from what ``dplab bench --json`` writes ({"meta", "rows"}), or a bare list of rows.

    Args:
        text: the JSON.
        name: where it came from, for the messages.

    Returns:
        The rows.

    Raises:
        ConfigError: not JSON, not ``dplab bench`` rows, or rows missing a key.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{name} is not JSON ({e}): give a file written by `dplab bench --json`"
        ) from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if isinstance(data, dict) and data.get("meta", {}).get("command", "bench") != "bench":
        raise ConfigError(f"{name} holds `dplab {data['meta']['command']}` rows: "
                          "give `dplab bench --json` output")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(
            f"{name} has no list of rows: give a file written by `dplab bench --json`"
        )
    for i, r in enumerate(rows):
        missing = [k for k in BENCH_KEYS if k not in r]
        if missing:
            raise ConfigError(f"{name}: row {i} lacks {', '.join(missing)}: give `dplab bench "
                              "--json` output")
    return rows
