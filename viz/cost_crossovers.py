"""Where two algorithms' cost curves cross, found on the size grid and pinned to a whole element.

    from dplab.viz.cost import CostParams
    from dplab.viz.cost_crossovers import merged_crossovers
    [m.sentence() for m in merged_crossovers(CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8))]
    # ['tree beats ring and direct below 91.9 KiB at p=8']

A crossover is where two algorithms' times change order: bracketed on the curve's size grid,
then bisected on the cost model itself, so the sentence is the model's answer, not a reading of
the plot. Chunks hold whole elements, so two algorithms equal on paper (ring and direct) swap
order with n mod p: within ``tie_tolerance`` (one element per message of both) they tie, and
curves that tie at every size are ``coinciding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any

from dplab.viz.cost import CostParams, features, format_bytes, model_time, size_grid

__all__ = ["Crossover", "MergedCrossover", "crossovers", "coinciding", "coinciding_sentence",
           "merged_crossovers", "tie_tolerance", "tolerant_sign"]


@dataclass(frozen=True)
class Crossover:
    """Below ``nbytes`` (exclusive) ``faster_below`` is the faster of the pair;
    from it on, the other."""

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
        home = next(
            (g for g in groups if all(tolerant_sign(g[0], a, n, params) == 0 for n in sizes)), None
        )
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
    return (f"{'; '.join(parts)} at p={world_size} (within one element per message), so their "
            f"curves coincide: {_and(tuple(dashed))} {'is' if len(dashed) == 1 else 'are'} drawn "
            f"dashed over {_and(tuple(g[0] for g in groups))}.")


def merged_crossovers(params: CostParams, points: int = 97,
                      xs: list[Crossover] | None = None) -> list[MergedCrossover]:
    """``crossovers`` with those of coinciding algorithms merged:
    "tree beats ring and direct below ...".

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
            out.append(
                MergedCrossover(
                    below, above, min(x.nbytes for x in cl), params.world_size, tuple(cl)
                )
            )
    return sorted(out, key=lambda m: (m.nbytes, m.faster_below, m.faster_above))


def _bisect(diff: Any, lo: int, hi: int, left_sign: int, itemsize: int) -> int:
    """Shrink [lo, hi] to one element: diff(lo) has ``left_sign`` (or is 0), diff(hi) not;
    returns hi."""
    while hi - lo > itemsize:
        mid = lo + (hi - lo) // itemsize // 2 * itemsize
        if _sign(diff(mid)) in (left_sign, 0):
            lo = mid
        else:
            hi = mid
    return hi
