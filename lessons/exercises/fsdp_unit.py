"""Exercise of lesson 10: an FSDP unit's gather and free, written by the learner.

    dplab lesson check 10 DIR         # runs DIR/fsdp_unit.py on local worlds of 1..4 ranks

FSDP (ZeRO-3) keeps only a shard of each unit's weights on a rank. The learner writes the two
moves around one unit (here a layer of an MLP):

    unit_forward(comm, shard, n, forward)               all-gather the n weights, return
                                                        forward(w), free w
    unit_backward(comm, shard, n, backward, grad_shard) all-gather again, g = backward(w), free w,
                                                        reduce-scatter g, keep this rank's chunk,
                                                        free g

The harness runs the model unit by unit for 2 steps on p = 1..4, and after every call checks:
the output against the unit run with its true whole weights, the gradient chunk against the
chunk of the summed gradient (the harness's own collectives, neither counted nor measured), the
bytes sent against one all-gather (forward) and an all-gather plus a reduce-scatter (backward),
and what the call left allocated when it returned (``tracemalloc``): gathered weights or a full
gradient kept past the call is the memory FSDP exists to free. After every step every rank's
gathered weights are held to one device (``train_single``).
"""

from __future__ import annotations

import base64
import signal
import tracemalloc
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

# the schedules, which collectives imports at its first call: imported before any step is
# measured, so that no module's import counts as memory the learner's step held
import dplab.reference.algorithms  # noqa: F401
from dplab.lessons.exercises.child import dplab_functions, patched_since, run_learner
from dplab.lessons.exercises.learner import Fail, load_function, same_process
from dplab.lessons.exercises.ranks import run_ranks, stop_before
from dplab.lessons.exercises.traffic import Traffic
from dplab.reference.collectives import allgather, allreduce
from dplab.reference.data import batch_indices, shard
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.zero.layers import layer_delta, layer_forward, layer_grads, output_delta
from dplab.reference.zero.traffic import collective_sent

__all__ = ["judge_fsdp", "collect_fsdp", "HINTS", "MODEL", "WORLD_SIZES", "STEPS", "KEPT_SHARE"]

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 2
TIMEOUT_S = 10.0
_RTOL = 1e-10
# eight units (544, 6 x 1,056, 132 weights); a batch of 8 keeps activations small beside a unit
MODEL = MLPConfig(in_dim=16, hidden=(32,) * 7, out_dim=4)
_CFG = TrainConfig(
    model=MODEL, global_batch=8, steps=STEPS, optimizer=OptimConfig("momentum", lr=0.05)
)
# another algorithm than the ring may send a little more;
# an all-reduce sends 4/3
_BYTES_SLACK = 1.2
# a call may leave this share of its unit's weight bytes allocated, or KEPT_FLOOR: the executor's
# caches of a first call stay, a kilobyte or two
KEPT_SHARE, KEPT_FLOOR = 0.5, 4096

HINTS = (
    "Before a unit runs, every rank needs the unit's WHOLE weights, and each rank holds one chunk "
    "of them: which collective turns p chunks into the whole on every rank? After the unit has "
    "run, what does the rank still need of it?",
    "Forward: w = np.empty(n, dtype=shard.dtype); a, b = chunk_bounds(n, p)[rank]; w[a:b] = shard; "
    "allgather(comm, w); return forward(w). Returning drops w: nothing kept.",
    "Backward: gather w the same way; g = backward(w); del w; reduce_scatter(comm, g); "
    "grad_shard[:] = g[a:b]. The summed chunk is all the optimizer needs: keep no g, no w.",
)


def judge_fsdp(file: Path, output: list[str]) -> str:
    """The learner's unit_forward/unit_backward on 1..4 ranks: values, bytes, memory left behind."""
    answer = run_learner("fsdp_unit", file, {"world_sizes": list(WORLD_SIZES)}, output)
    oracle = [train_single(replace(_CFG, steps=k)).params for k in range(STEPS + 1)]
    net = MLP(MODEL)
    sizes = [net.layer_slice(i).stop - net.layer_slice(i).start for i in range(net.num_layers)]
    for p, run in zip(WORLD_SIZES, answer["data"].get("runs", [])):
        problem = next((r["problem"] for r in run if r["problem"]), None)
        problem = problem or _too_many_bytes(run, sizes, p) or _kept(run, sizes)
        if problem:
            raise Fail(f"at p={p}: {problem}")
        for r, rank in enumerate(run):
            for t, text in enumerate(rank["after"]):
                got = np.frombuffer(base64.b64decode(text), dtype=np.float64)
                if got.shape != oracle[t + 1].shape or not np.allclose(
                    got, oracle[t + 1], rtol=0, atol=_RTOL * np.abs(oracle[-1]).max()
                ):
                    raise Fail(f"at p={p}: after step {t} rank {r}'s weights differ from one "
                               "device's")
    if answer["fail"]:
        raise Fail(answer["fail"])
    return (f"right on 1..{WORLD_SIZES[-1]} ranks: every unit gathered before it ran and freed "
            f"after, its gradient reduce-scattered to one chunk per rank ({len(sizes)} units, "
            f"{sum(sizes):,} weights), 3 collectives a unit a step, and after each step every "
            "rank's weights as one device's")


def _too_many_bytes(run: list[dict[str, Any]], sizes: list[int], p: int) -> str | None:
    for phase, kinds in (
        ("forward", ("allgather",)),
        ("backward", ("allgather", "reduce_scatter")),
    ):
        for u, n in enumerate(sizes):
            want = sum(8 * collective_sent(k, "ring", p, r, n) for k in kinds for r in range(p))
            calls = [
                c for rank in run for c in rank["calls"] if c["phase"] == phase and c["unit"] == u
            ]
            steps = len(calls) // p if p else 0
            sent = sum(c["sent"] for c in calls) / max(steps, 1)
            if sent <= _BYTES_SLACK * want:
                continue
            called = Counter()
            for c in calls:
                called.update(c["called"])
            said = ", ".join(f"{k} {v / max(len(calls), 1):g}x" for k, v in sorted(called.items()))
            if called.get("allreduce") and phase == "forward":
                why = ("an all-reduce of zero-padded weights sends twice an all-gather's bytes: "
                       "allgather fills in the other ranks' chunks")
            elif called.get("allreduce"):
                why = ("an all-reduce leaves the whole summed gradient on every rank, but a rank "
                       "keeps only its chunk: reduce_scatter sends half an all-reduce's bytes")
            else:
                why = f"FSDP's {phase} of a unit needs {' and '.join(kinds)}, once each"
            return (f"unit {u}'s {phase} sent {sent / want:.2f}x the bytes it needs ({sent:,.0f} "
                    f"against {want:,} over the ranks; each call: {said}): {why}")
    return None


def _kept(run: list[dict[str, Any]], sizes: list[int]) -> str | None:
    for r, rank in enumerate(run):
        for c in rank["calls"]:
            allow = max(KEPT_SHARE * 8 * sizes[c["unit"]], KEPT_FLOOR)
            if c["kept"] <= allow:
                continue
            what = ("the gathered weights are still held after the unit's forward: FSDP frees them "
                    "once the unit has run and gathers them again for backward (that is what keeps "
                    "a rank at a shard plus one unit)") if c["phase"] == "forward" else \
                ("a whole weight or gradient buffer is still held after the unit's backward: keep "
                 "only your chunk, in grad_shard, and let the gathered weights and the full "
                 "gradient go")
            unit_kib = 8 * sizes[c["unit"]] / 1024
            return (f"rank {r}'s {c['phase']} of unit {c['unit']} left {c['kept'] / 1024:.1f} KiB "
                    f"allocated when it returned (the unit's weights are {unit_kib:.1f} KiB): "
                    f"{what}")
    return None


def collect_fsdp(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: for each p, every rank's calls (bytes, memory kept), first problem, weights."""
    load_function(file, "unit_forward")
    load_function(file, "unit_backward")
    out["runs"] = runs = []
    for p in inputs["world_sizes"]:
        done = run_ranks(_rank, p, (str(file), _CFG, deadline), file, "the unit", TIMEOUT_S)
        runs.append([{k: rank[k] for k in ("calls", "problem", "after")} for rank in done])
        if any(rank["problem"] for rank in done):
            break


def _gather(comm: Any, piece: np.ndarray, n: int) -> np.ndarray:
    """The harness's own all-gather of a unit (not counted, not measured)."""
    a, b = chunk_bounds(n, comm.world_size)[comm.rank]
    w = np.zeros(n, dtype=piece.dtype)
    w[a:b] = piece
    allgather(comm, w)
    return w


def _rank(comm: Any, file: str, cfg: TrainConfig, deadline: float) -> dict[str, Any]:
    stop_before(deadline)
    before = dplab_functions()
    unit_forward = load_function(Path(file), "unit_forward")
    # one module: what they share, they share
    unit_backward = unit_forward.__globals__["unit_backward"]
    model, data, init = setup(cfg)
    p, r = comm.world_size, comm.rank
    slices = [model.layer_slice(i) for i in range(model.num_layers)]
    sizes = [s.stop - s.start for s in slices]
    own = [chunk_bounds(n, p)[r] for n in sizes]
    shards = [init[s][a:b].copy() for s, (a, b) in zip(slices, own)]
    opts = [make_optimizer(cfg.optimizer, b - a, init.dtype) for a, b in own]
    traffic = Traffic.install(comm)
    calls: list[dict[str, Any]] = []
    after: list[str] = []
    problem = ""

    def measured(phase: str, unit: int, fn: Any, *args: Any) -> Any:
        nonlocal problem
        traffic.start()
        # only this call's allocations: what is still traced at its end, it kept
        tracemalloc.start()
        try:
            with same_process():
                result = fn(comm, *args)
            held = result.nbytes if isinstance(result, np.ndarray) else 0
            kept = tracemalloc.get_traced_memory()[0] - held
            problem = problem or traffic.tampered(comm, f"unit_{phase}")
        finally:
            tracemalloc.stop()
        traffic.stop()
        calls.append({"phase": phase, "unit": unit, "sent": traffic.sent,
                      "called": {k: v for k, v in traffic.called.items() if v},
                      "kept": kept})
        return result

    for step in range(cfg.steps):
        if problem:  # the first wrong call is the verdict: no need to run on
            break
        idx = shard(batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed), r, p)
        x, y = data.x[idx].astype(init.dtype), data.y[idx]
        acts = [x]
        for u, n in enumerate(sizes):
            w_true = _gather(comm, shards[u], n)
            want = layer_forward(model, u, w_true, acts[-1])
            del w_true

            def forward(w: np.ndarray, u: int = u, a: np.ndarray = acts[-1]) -> np.ndarray:
                return layer_forward(model, u, w, a)

            got = measured("forward", u, unit_forward, shards[u], n, forward)
            if not problem and not (isinstance(got, np.ndarray) and got.shape == want.shape
                                    and np.allclose(got, want, rtol=1e-12, atol=1e-14)):
                problem = (f"rank {r}'s forward of unit {u} returned something other than the unit "
                           "run with its whole weights: gather every rank's shard into w, each at "
                           "chunk_bounds(n, p)[rank], then return forward(w)")
            acts.append(want)
        delta = output_delta(model, acts[-1], y, 1 / cfg.global_batch)
        for u in reversed(range(len(sizes))):
            n, (a, b) = sizes[u], own[u]
            w_true = _gather(comm, shards[u], n)
            local = np.zeros(n, dtype=init.dtype)
            layer_grads(model, u, acts[u], delta, local)
            summed = local.copy()
            allreduce(comm, summed)
            next_delta = layer_delta(model, u, w_true, acts[u], delta) if u else None
            del w_true
            asked: list[bool] = []

            def backward(w: np.ndarray, u: int = u, a: np.ndarray = acts[u], d: np.ndarray = delta,
                         asked: list[bool] = asked) -> np.ndarray:
                asked.append(True)
                g = np.zeros(len(w), dtype=w.dtype)
                layer_grads(model, u, a, d, g)
                return g

            grad_shard = np.zeros(b - a, dtype=init.dtype)
            measured("backward", u, unit_backward, shards[u], n, backward, grad_shard)
            if not problem:
                problem = _wrong_grad(r, u, p, grad_shard, summed[a:b], local[a:b], bool(asked))
            opts[u].step(shards[u], grad_shard)
            delta = next_delta
            del local, summed
        after.append(
            base64.b64encode(
                np.concatenate([_gather(comm, s, n) for s, n in zip(shards, sizes)]).tobytes()
            ).decode()
        )
    signal.setitimer(signal.ITIMER_REAL, 0)
    return {
        "calls": calls,
        "problem": problem,
        "after": after,
        "patched": patched_since(before, Path(file)),
    }


def _wrong_grad(r: int, u: int, p: int, got: np.ndarray, want: np.ndarray, local: np.ndarray,
                asked: bool) -> str:
    """What is wrong with rank r's gradient chunk of unit u, or ''."""
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)

    def close(x: np.ndarray) -> bool:
        return bool(np.abs(got - x).max(initial=0.0) <= _RTOL * scale)

    where = f"rank {r}'s grad_shard of unit {u}"
    if close(want):
        return ""
    if not asked:
        return (f"{where} was filled without calling backward(w): "
                "the unit's gradient comes from backward(w)")
    if not got.any():
        return (f"{where} was left at zero: write your chunk of the summed gradient into it, "
                "grad_shard[:] = g[a:b]")
    if p > 1 and close(want / p):
        return (
            f"{where} is 1/{p} of the summed gradient: it was averaged, but each rank's loss is "
            "already scaled by 1/global batch, so the ranks' gradients are summed (reduce_scatter "
            "sums)"
        )
    if p > 1 and close(local):
        return (f"{where} is this rank's own gradient, not the sum over the ranks: reduce-scatter "
                "g before taking your chunk")
    return (f"{where} differs from chunk {r} of the gradient summed over the ranks by "
            f"{np.abs(got - want).max():.3g}: reduce_scatter(comm, g) leaves that sum in "
            "chunk_bounds(n, p)[rank]")
