"""Exercise of lesson 10: clipping by the global norm when every rank holds a shard of the gradient.

    dplab lesson check 10 DIR         # runs DIR/sharded_clip.py on local worlds of 1..3 ranks

The learner's ``sharded_clip(comm, backward, shard, max_norm)`` runs on every rank: the stub's loop
reduce-scatters each layer of the real backward pass and keeps this rank's chunk in
``shard[layer]``; the learner clips those chunks so that the WHOLE gradient's norm is at most
``max_norm``, and returns that norm. Judged at p = 1..3, once with ``max_norm`` a quarter of the
norm (it must clip) and once at four times it (it must not), against
``torch.nn.utils.clip_grad_norm_`` on one device with the whole gradient (NumPy's norm with
torch's coefficient where torch is not installed): every chunk, the norm returned, and the bytes
sent (the norm needs one number per rank, not the gradient).

A wrong answer is named by what its chunks show: one coefficient per rank (each shard clipped by
its own norm), one per layer (clipped layer by layer, or before every reduce-scatter completed),
no coefficient at all (clipped before the reduce-scatter summed the ranks' gradients), or one
coefficient from the wrong norm (the norms all-reduced instead of their squares, the square root
forgotten, the squares averaged), or scaled up.
"""

from __future__ import annotations

import base64
import math
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from dplab.lessons.exercises.child import dplab_functions, patched_since, run_learner
from dplab.lessons.exercises.learner import Fail, load_function, same_process
from dplab.lessons.exercises.ranks import run_ranks, stop_before
from dplab.lessons.exercises.traffic import Traffic
from dplab.lessons.exercises.zero2 import backward_layers
from dplab.reference.data import batch_indices, shard
from dplab.reference.model import MLPConfig
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, setup
from dplab.reference.zero.clip import clip_coef
from dplab.reference.zero.traffic import collective_sent

__all__ = ["judge_sharded_clip", "collect_sharded_clip", "oracle", "HINTS", "MODEL", "WORLD_SIZES",
           "FACTORS"]

WORLD_SIZES = (1, 2, 3)  # one rank; an even split; an uneven one (544 = 182 + 181 + 181)
FACTORS = (0.25, 4.0)  # max_norm as a multiple of the true norm: it must clip, then it must not
TIMEOUT_S = 10.0
_RTOL = 1e-10  # float64 against one device: the sums' order only
_NAMED = 1e-6  # a norm implied by a coefficient, matched against a named mistake's norm
# five layers (544, 3 x 1,056, 132 parameters), a batch of 8: every rank owns a chunk of each
MODEL = MLPConfig(in_dim=16, hidden=(32,) * 4, out_dim=4)
_CFG = TrainConfig(model=MODEL, global_batch=8, steps=1)
_BYTES_SLACK = 1.2  # the reduce-scatters' bytes, and a little: the norm's all-reduce is a few bytes
_NORM_BYTES = 256  # per rank: an all-reduce of one float64, whatever the schedule

HINTS = (
    "No rank holds the whole gradient, but every rank must scale by the coefficient the whole "
    "gradient has. What can each rank compute from its own chunks that ADDS UP, across the ranks, "
    "to ||g||²?",
    "||g||² is the sum of the squares of all its elements, and the ranks' chunks are disjoint: "
    "||g||² = Σ_r ||g_r||². So: sq = np.array([sum(float(s @ s) for s in shard)]); allreduce(comm, "
    "sq) (a sum: not op='mean'); norm = math.sqrt(sq[0]).",
    "After the loop (every reduce-scatter done): the all-reduced squares, their square root, then "
    "coef = min(1.0, max_norm / (norm + 1e-6)) on every chunk: `for s in shard: s *= coef`; return "
    "norm.",
)


def judge_sharded_clip(file: Path, output: list[str]) -> str:
    """The learner's sharded_clip on 1..3 ranks: chunks and norm against torch's, one device."""
    full = _gradient()
    total, _ = oracle(full, math.inf)
    max_norms = [f * total for f in FACTORS]
    inputs = {"world_sizes": list(WORLD_SIZES), "max_norms": max_norms}
    answer = run_learner("sharded_clip", file, inputs, output)
    for p, run in zip(WORLD_SIZES, answer["data"].get("runs", [])):
        for c, max_norm in enumerate(max_norms):
            problem = _judge_case(p, [rank["cases"][c] for rank in run], full, max_norm)
            if problem:
                raise Fail(f"at p={p}, max_norm {max_norm:.4g} ({FACTORS[c]:g}x the norm "
                           f"{total:.4g}): {problem}")
    if answer["fail"]:
        raise Fail(answer["fail"])
    return (f"right on 1..{WORLD_SIZES[-1]} ranks: every chunk and the norm you return "
            f"({total:.6g}) are what torch.nn.utils.clip_grad_norm_ gives on one device with the "
            f"whole gradient, clipped at max_norm {max_norms[0]:.4g} and left alone at "
            f"{max_norms[1]:.4g}; the norm cost one all-reduce of a number per rank")


def oracle(layers: list[np.ndarray], max_norm: float) -> tuple[float, list[np.ndarray]]:
    """``torch.nn.utils.clip_grad_norm_`` on the whole gradient, one device: (norm, clipped layers).

    Without torch, NumPy's norm and torch's coefficient (``reference/zero/clip.py``)."""
    try:
        import torch
    except ImportError:
        total = float(np.linalg.norm(np.concatenate(layers)))
        return total, [g * clip_coef(total, max_norm) for g in layers]
    params = [torch.zeros(len(g), dtype=torch.float64, requires_grad=True) for g in layers]
    for t, g in zip(params, layers):
        t.grad = torch.tensor(g)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(total), [t.grad.numpy().copy() for t in params]


def _gradient() -> list[np.ndarray]:
    """The one-device gradient of the step's batch, layer by layer."""
    model, data, init = setup(_CFG)
    batch = batch_indices(_CFG.num_samples, _CFG.global_batch, 0, _CFG.seed)
    full = np.zeros(model.num_params)
    model.loss_and_grad(init, data.x[batch], data.y[batch], 1 / _CFG.global_batch, full)
    return [full[model.layer_slice(i)] for i in range(model.num_layers)]


def _judge_case(p: int, ranks: list[dict[str, Any]], full: list[np.ndarray],
                max_norm: float) -> str | None:
    """What is wrong with one case's chunks, norms and bytes, or None."""
    total, clipped = oracle(full, max_norm)
    bounds = [chunk_bounds(len(g), p) for g in full]
    want = [[clipped[lay][slice(*bounds[lay][r])] for lay in range(len(full))] for r in range(p)]
    summed = [[full[lay][slice(*bounds[lay][r])] for lay in range(len(full))] for r in range(p)]
    got = []
    for r, case in enumerate(ranks):
        if case["norm"] is None:
            return (f"sharded_clip returned {case['returned']} on rank {r}: return the global norm "
                    "before clipping, a number, as torch.nn.utils.clip_grad_norm_ does")
        flat = np.frombuffer(base64.b64decode(case["chunks"]), dtype=np.float64)
        cuts = np.cumsum([0, *(len(s) for s in want[r])])
        if len(flat) != cuts[-1]:
            return (f"rank {r}'s shard changed size: clip its chunks in place (s *= coef), keep "
                    "their lengths")
        got.append([flat[a:b] for a, b in zip(cuts, cuts[1:])])
    scale = max(float(np.abs(g).max()) for g in full)
    norms = [case["norm"] for case in ranks]
    right = all(np.abs(g - w).max(initial=0.0) <= _RTOL * scale for gr, wr in zip(got, want)
                for g, w in zip(gr, wr))
    if not right:
        return _wrong_chunks(p, got, summed, total, max_norm)
    for r, norm in enumerate(norms):
        if not math.isclose(norm, total, rel_tol=_RTOL):
            named = _named_norm(norm, p, summed, total, r)
            named = named or ("return the norm of the whole gradient, before clipping, the same on "
                              "every rank")
            return (f"the chunks are right, but rank {r} returned {norm:.6g} where the global norm "
                    f"is {total:.6g}: {named}")
    return _too_many_bytes(p, ranks, full)


def _wrong_chunks(p: int, got: list[list[np.ndarray]], summed: list[list[np.ndarray]], total: float,
                  max_norm: float) -> str:
    """Name the mistake from the coefficients the chunks were scaled by (one per rank and layer)."""
    coef = [[0.0] * len(summed[0]) for _ in range(p)]
    for r in range(p):
        for lay, (g, s) in enumerate(zip(got[r], summed[r])):
            c = float(g @ s / (s @ s)) if s.any() else 1.0
            if np.abs(g - c * s).max(initial=0.0) > 1e-9 * max(np.abs(s).max(initial=0.0), 1e-300):
                return _before_reduce_scatter(r, lay)
            coef[r][lay] = c
    right = clip_coef(total, max_norm)
    by_layer = [len({round(c, 9) for c in row}) > 1 for row in coef]
    if any(by_layer):
        r = by_layer.index(True)
        first, last = len(coef[r]) - 1, 0  # backward's order: the last layer arrives first
        layer_norms = [math.sqrt(sum(float(summed[q][lay] @ summed[q][lay]) for q in range(p)))
                       for lay in range(len(coef[r]))]
        if all(math.isclose(c, clip_coef(n, max_norm), rel_tol=_NAMED)
               for c, n in zip(coef[r], layer_norms)):
            return (f"each layer was clipped by its own norm (rank {r} scaled layer {first} by "
                    f"{coef[r][first]:.4g} and layer {last} by {coef[r][last]:.4g}), but "
                    f"clip_grad_norm_ scales the whole gradient by one coefficient, {right:.4g}, "
                    "from the norm of all the layers together: add the squares over every layer "
                    "before the square root")
        return (f"rank {r} scaled layer {first} by {coef[r][first]:.4g} and layer {last} by "
                f"{coef[r][last]:.4g}: it clipped before every layer's reduce-scatter had "
                "completed (inside the backward loop), so the norm it used missed the layers "
                "still to come. The global norm needs every layer's chunk: clip once, after the "
                f"loop, with one coefficient ({right:.4g} here)")
    per_rank = [row[0] for row in coef]
    if len({round(c, 9) for c in per_rank}) > 1:
        own = [math.sqrt(sum(float(s @ s) for s in summed[r])) for r in range(p)]
        hi, lo = max(range(p), key=per_rank.__getitem__), min(range(p), key=per_rank.__getitem__)
        said = (f"rank {lo} scaled its chunks by {per_rank[lo]:.4g} and rank {hi} by "
                f"{per_rank[hi]:.4g}")
        if all(math.isclose(c, clip_coef(n, max_norm), rel_tol=_NAMED)
               for c, n in zip(per_rank, own)):
            return (f"{said}: each rank clipped by the norm of its own shard (rank {lo}'s is "
                    f"{own[lo]:.4g}), but the whole gradient's norm is {total:.4g}, and every rank "
                    f"must scale by the same coefficient, {right:.4g}: all-reduce the shards' "
                    "squared norms, then take the square root")
        return (f"{said}: every rank must scale by the same coefficient, {right:.4g}, from the "
                "norm of the whole gradient")
    c = per_rank[0]
    if c > 1 + 1e-9:
        return (f"every chunk was scaled UP by {c:.4g}: the coefficient is min(1, max_norm / (norm "
                "+ 1e-6)), and clipping never enlarges a gradient whose norm is already below "
                "max_norm")
    if right == 1.0:
        implied = None
        said = (f"every chunk was scaled by {c:.4g}, but the whole gradient's norm {total:.4g} is "
                "below max_norm")
    elif c >= 1 - 1e-12:
        implied = None
        said = (f"the chunks were not scaled, but the whole gradient's norm {total:.4g} is above "
                f"max_norm {max_norm:.4g}: each chunk must be scaled by {right:.4g}")
    else:
        implied = max_norm / c - 1e-6
        said = f"every chunk was scaled by {c:.4g} where one device scales by {right:.4g}"
    named = _named_norm(implied, p, summed, total) if implied is not None else None
    if named:
        return f"{said}: the norm behind it is {implied:.4g}, not {total:.4g}: {named}"
    return (f"{said}: clip by the norm of the whole gradient, the square root of the SUM over the "
            "ranks of their shards' squared norms")


def _named_norm(norm: float, p: int, summed: list[list[np.ndarray]], total: float,
                rank: int = 0) -> str | None:
    """The mistake that computes ``norm`` where the global norm is ``total``, or None."""
    own = [math.sqrt(sum(float(s @ s) for s in summed[r])) for r in range(p)]
    named = (
        (sum(own), "the shards' NORMS were all-reduced, but norms do not add, their squares do "
                   "(||g||² = Σ_r ||g_r||²): all-reduce the squared norms, then take the square "
                   "root"),
        (total ** 2, "that is ||g||², the all-reduced sum of the squares: the square root is "
                     "missing"),
        (total / math.sqrt(p), "that is the square root of the MEAN of the squared norms: the "
                               "all-reduce averaged them (op='mean') where it must sum: ||g||² = "
                               "Σ_r ||g_r||²"),
        (total ** 2 / p, "that is the MEAN of the squared norms, and without the square root: sum "
                         "them (the all-reduce's default), then take the square root"),
        (sum(own) / p, "that is the mean of the shards' norms: norms neither add nor average; "
                       "all-reduce (sum) the squared norms, then take the square root"),
        (own[rank], f"that is rank {rank}'s own shard's norm: all-reduce the squared norms of "
                    "every rank's shard, then take the square root"),
    )
    return next((why for value, why in named if math.isclose(norm, value, rel_tol=_NAMED)), None)


def _before_reduce_scatter(r: int, layer: int) -> str:
    return (f"rank {r}'s chunk of layer {layer} is not a multiple of the summed gradient's chunk: "
            "it was scaled before the reduce-scatter summed the ranks' gradients, each rank's own "
            "gradient by its own coefficient, so the sum is no longer the gradient's direction. "
            "Clip after every reduce-scatter has completed: the summed chunks, all by one "
            "coefficient")


def _too_many_bytes(p: int, ranks: list[dict[str, Any]], full: list[np.ndarray]) -> str | None:
    want = sum(8 * collective_sent("reduce_scatter", "ring", p, r, len(g))
               for g in full for r in range(p))
    sent = sum(case["sent"] for case in ranks)
    if sent <= _BYTES_SLACK * want + _NORM_BYTES * p:
        return None
    called: Counter[str] = Counter()
    for case in ranks:
        called.update(case["called"])
    said = ", ".join(f"{k} {v // p}x" for k, v in sorted(called.items()) if v)
    return (f"the ranks sent {sent:,} bytes where the reduce-scatters need {want:,} and the norm a "
            f"few more (each rank called {said}): to take the norm, all-reduce ONE number per "
            "rank, its shard's squared norm; gathering the gradient (or all-reducing it) moves "
            "all of it, which ZeRO exists to avoid")


def collect_sharded_clip(file: Path, inputs: dict[str, Any], out: dict[str, Any],
                         deadline: float) -> None:
    """In the child: for each p and max_norm, every rank's clipped chunks, norm and bytes."""
    load_function(file, "sharded_clip")
    out["runs"] = runs = []
    for p in inputs["world_sizes"]:
        done = run_ranks(_rank, p, (str(file), inputs["max_norms"], deadline), file,
                         "sharded_clip", TIMEOUT_S)
        runs.append([{"cases": rank["cases"]} for rank in done])


def _rank(comm: Any, file: str, max_norms: list[float], deadline: float) -> dict[str, Any]:
    """One rank: its samples' real backward, the learner's clip, what came back, what was sent."""
    stop_before(deadline)
    before = dplab_functions()
    sharded_clip = load_function(Path(file), "sharded_clip")
    model, data, init = setup(_CFG)
    params = [init[model.layer_slice(i)] for i in range(model.num_layers)]
    p, r = comm.world_size, comm.rank
    idx = shard(batch_indices(_CFG.num_samples, _CFG.global_batch, 0, _CFG.seed), r, p)
    traffic = Traffic.install(comm)
    cases, tampered = [], ""
    for max_norm in max_norms:
        chunks = [np.zeros(b - a) for a, b in (chunk_bounds(len(w), p)[r] for w in params)]
        backward = backward_layers(model, params, data.x[idx], data.y[idx], 1 / _CFG.global_batch)
        traffic.start()
        with same_process():
            norm = sharded_clip(comm, backward, chunks, max_norm)
        traffic.stop()
        if comm.tracer is not traffic.tracer and not tampered:  # Traffic.tampered wants tracemalloc
            tampered = ("sharded_clip replaced comm.tracer, through which the check counts the "
                        "bytes your collectives send: leave comm.tracer as it is")
        try:
            value = float(norm)
        except (TypeError, ValueError):
            value = None
        value = value if value is not None and math.isfinite(value) else None
        flat = np.concatenate([np.asarray(c, dtype=np.float64).ravel() for c in chunks])
        cases.append({"norm": value, "returned": repr(norm)[:80], "sent": traffic.sent,
                      "called": dict(traffic.called),
                      "chunks": base64.b64encode(flat.tobytes()).decode()})
    signal.setitimer(signal.ITIMER_REAL, 0)
    return {"cases": cases, "patched": patched_since(before, Path(file)), "tampered": tampered}
