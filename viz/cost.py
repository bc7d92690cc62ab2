"""The alpha-beta-gamma model as curves: one per algorithm, in time, algbw or busbw.

    from dplab.viz.cost import CostParams
    from dplab.viz.cost_crossovers import crossovers, merged_crossovers
    from dplab.viz.cost_figure import cost_figure
    params = CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8)
    [c.sentence() for c in crossovers(params)]  # [..., 'tree beats ring below 91.9 KiB at p=8']
    [m.sentence() for m in merged_crossovers(params)]
    # ['tree beats ring and direct below 91.9 KiB at p=8']
    cost_figure(params).show()

Every number is ``dplab.reference.costmodel.cost`` over the schedule the executor runs
(``allreduce_schedule``). A crossover (``cost_crossovers.py``) is found on the size grid, then
pinned to a whole element by bisection on the model. Algorithms that tie at every size (ring and
direct) are ``coinciding``: one marker and one sentence, all but the first dashed in the figure
(``cost_figure.py``). The measured side (bench rows, the alpha/beta fit) is ``dplab.viz.cost_fit``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dplab.backends.bench.timing import busbw_factor
from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError

__all__ = ["CostParams", "COLORS", "Y_AXES", "DASHES", "size_grid", "model_time", "curves",
           "features", "to_y", "format_bytes", "busbw_line"]

_PALETTE = ("#7f7f7f", "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#17becf", "#e377c2", "#bcbd22",
            # D3's category10, then more: one per algorithm
            "#8c564b", "#393b79", "#637939", "#7b4173")
COLORS = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(ALLREDUCE)} | {
    "native": "#9467bd"
}
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
            raise ConfigError(f"alpha must be >= 0 s and beta > 0 GB/s, got {self.alpha_s}, "
                              f"{self.beta_gbps}")
        if self.gamma_gbps is not None and self.gamma_gbps <= 0:
            raise ConfigError("gamma must be > 0 GB/s (or None: reduction free), got "
                              f"{self.gamma_gbps}")
        if self.world_size < 2:
            raise ConfigError(f"world size must be >= 2 (one rank has nothing to reduce), "
                              f"got {self.world_size}")
        if not self.itemsize <= self.min_bytes < self.max_bytes:
            raise ConfigError(
                f"message sizes must satisfy itemsize <= min < max, got "
                f"{self.min_bytes}..{self.max_bytes} bytes (itemsize {self.itemsize})"
            )
        unknown = [a for a in self.algorithms if a not in ALLREDUCE]
        if unknown:
            raise ConfigError(f"no cost model for {', '.join(unknown)}: choose from "
                              f"{', '.join(ALLREDUCE)}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.beta_gbps * 1e9)

    @property
    def gamma(self) -> float:
        return 0.0 if self.gamma_gbps is None else 1.0 / (self.gamma_gbps * 1e9)


def size_grid(params: CostParams, points: int = 97) -> list[int]:
    """Log-spaced message sizes, whole elements, both ends included."""
    lo, hi = params.min_bytes // params.itemsize, params.max_bytes // params.itemsize
    elems = np.unique(np.round(np.geomspace(lo, hi, points)).astype(np.int64))
    return [int(e) * params.itemsize for e in elems]


# The page's captions, its figure and every pair of crossovers ask for the same prices: each is
# worked out once (a few thousand of a render's tens of thousands of asks).
@functools.lru_cache(maxsize=1 << 15)
def model_time(algorithm: str, nbytes: int, params: CostParams) -> float:
    """Seconds for one all-reduce of ``nbytes``: the cost model over the executor's schedule."""
    s = allreduce_schedule(algorithm, params.world_size)
    return cost(s, nbytes, params.alpha_s, params.beta, params.gamma, params.itemsize).time


def curves(params: CostParams, points: int = 97) -> dict[str, tuple[list[int], list[float]]]:
    """Per algorithm: (sizes in bytes, seconds)."""
    sizes = size_grid(params, points)
    return {a: (sizes, [model_time(a, n, params) for n in sizes]) for a in params.algorithms}


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


@functools.lru_cache(maxsize=1 << 12)  # every pair's tie tolerance asks for the same ones
def features(
    algorithm: str, world_size: int, nbytes: int, itemsize: int = 4
) -> tuple[float, float]:
    """(latency terms, bytes on the critical path) of one all-reduce, read off its schedule.

    The cost model is linear in alpha and beta (for these schedules the slowest rank of a round is
    the same whichever term dominates; ``tests/test_viz_cost_model.py`` checks it), so
    ``time = a * alpha + b * beta`` with a = cost at (1, 0, 0) and b = cost at (0, 1, 0).
    a is the rounds for ring and tree and 2(p-1) for naive and direct (p-1 messages queue at one
    port); b is 2(p-1)/p · n for ring and direct, 2⌈lg p⌉·n for tree, 2(p-1)·n for naive.
    """
    s = allreduce_schedule(algorithm, world_size)
    return (
        cost(s, nbytes, 1.0, 0.0, 0.0, itemsize).time,
        cost(s, nbytes, 0.0, 1.0, 0.0, itemsize).time,
    )
