"""Exercise of lesson 4: DDP's bucket assignment, written by the learner.

    dplab lesson check 4 DIR          # runs DIR/ddp_buckets.py

The learner's ``ddp_buckets(sizes, cap)`` takes the parameters' gradient sizes in bytes, in
forward order, and the bucket cap in bytes, and returns the buckets as lists of parameter
indices. It is judged three ways: against the engine's own ``assign_buckets``
(``dplab.reference.train.buckets``) on lesson 4's model; by training that model on 3 ranks with
the learner's buckets in the engine's ``Reducer`` and comparing with one device
(``train_single``, the oracle); and against ``assign_buckets`` on 200 random cases. The verdict
speaks of gradients arriving: "bucket 0 holds parameter 0 but parameter 5's gradient arrives
first: buckets follow the reverse order of the parameters".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from dplab.backends import launch
from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import (
    Fail,
    learner_call,
    load_function,
    rank_failure,
    short_repr,
)
from dplab.reference.train import buckets as engine
from dplab.reference.train.single import TrainConfig, TrainResult, setup, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["judge_buckets", "collect_buckets", "engine_buckets", "bucket_problem", "MODEL_CAP",
           "RANDOM_CASES", "EDGE_CASES", "MAX_INDICES"]

MODEL_CAP = 600  # bytes: lesson 4's model (six parameters, 32..2,048 bytes) in three buckets
RANDOM_CASES = 200
# the edges random sizes rarely hit: a bucket exactly at the cap, a parameter larger than the cap,
# one parameter, everything in one bucket
EDGE_CASES = [([100, 100, 100, 100], 200), ([10, 5000, 10], 100), ([64], 1), ([7, 7, 7], 10**9)]
_WORLD = 3
MAX_INDICES = 10_000  # per answer: the cases have at most 12 parameters
_RTOL = 1e-10  # float64 against one device: rounding only


def engine_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """What the engine's Reducer makes of these sizes (bytes) and this cap (bytes)."""
    slices, start = [], 0
    for n in sizes:
        slices.append(slice(start, start + n))
        start += n
    return engine.assign_buckets(slices, 1, cap / 2**20)


def judge_buckets(file: Path, output: list[str]) -> str:
    """The learner's ddp_buckets against the engine's, in training, and on random cases."""
    cfg = TrainConfig(steps=3)
    model, _, params = setup(cfg)
    sizes = [(s.stop - s.start) * params.itemsize for s in model.param_slices]
    rng = np.random.default_rng(4)
    randoms = [([int(x) for x in rng.integers(1, 5000, size=int(rng.integers(1, 13)))],
                int(rng.integers(1, 8000))) for _ in range(RANDOM_CASES)]
    cases = [(sizes, MODEL_CAP)] + EDGE_CASES + randoms
    answer = run_learner("ddp_buckets", file, {"cases": cases}, output)
    got = answer["data"].get("buckets", [])
    for i, ((case, cap), mine) in enumerate(zip(cases, got)):
        problem = bucket_problem(mine, engine_buckets(case, cap), case, cap)
        if problem and i == 0:
            raise Fail(f"for lesson 4's model (gradients of {sizes} bytes, cap {MODEL_CAP:,}): "
                       f"{problem}")
        if problem:
            raise Fail(f"for gradients of {case} bytes and cap {cap:,}: {problem}")
        if i == 0:
            diff = _train(cfg, mine, file)
    if answer["fail"]:
        raise Fail(answer["fail"])
    return (f"your buckets {got[0]} for lesson 4's model trained 3 steps on {_WORLD} ranks to "
            f"within {diff:.1e} of one device, and they match the engine's on {len(EDGE_CASES)} "
            f"edge and {RANDOM_CASES} random cases")


def collect_buckets(
    file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float
) -> None:
    """In the child: the learner's buckets for each case, as lists of ints (``out["buckets"]``)."""
    fn = load_function(file, "ddp_buckets")
    out["buckets"] = results = []
    for sizes, cap in inputs["cases"]:
        what = f"ddp_buckets({sizes}, {cap})"
        with learner_call(file, what):
            got = fn(list(sizes), cap)
            results.append(_plain_buckets(got, what))


def _plain_buckets(got: Any, what: str) -> list[list[int]]:
    """``got`` as a list of lists of ints, reading at most ``MAX_INDICES`` indices (a generator that
    never ends, a list of a billion, stop there), or ``Fail``."""
    buckets, n = [], 0
    try:
        for b in got:
            bucket = []
            for i in b:
                n += 1
                if n > MAX_INDICES:
                    raise Fail(f"{what} returned more than {MAX_INDICES:,} parameter indices: "
                               "return one list of indices per bucket, each parameter in exactly "
                               "one")
                if int(i) != i:
                    raise ValueError(i)
                bucket.append(int(i))
            buckets.append(bucket)
    except (TypeError, ValueError, OverflowError):
        raise Fail(f"{what} returned {short_repr(got)}: return a list of buckets, each a list of "
                   "parameter indices") from None
    return buckets


def bucket_problem(
    got: list[list[int]], want: list[list[int]], sizes: list[int], cap: int
) -> str | None:
    """What is wrong with ``got`` (the engine made ``want``), in the words of gradients arriving."""
    n = len(sizes)
    where: dict[int, int] = {}
    for b, bucket in enumerate(got):
        if not bucket:
            return f"bucket {b} is empty: every bucket holds at least one parameter"
        for i in bucket:
            if not 0 <= i < n:
                return f"bucket {b} names parameter {i}, but the parameters are 0..{n - 1}"
            if i in where:
                return (f"parameter {i} is in buckets {where[i]} and {b}: its gradient would be "
                        "all-reduced twice")
            where[i] = b
    for i in range(n):
        if i not in where:
            return (f"parameter {i} is in no bucket: its gradient would never be all-reduced, and "
                    "the replicas would drift apart")
    nxt = n - 1  # the next gradient backward makes: the last parameter's first
    for b, bucket in enumerate(got):
        run = sorted(bucket, reverse=True)
        if run[0] != nxt:
            return (f"bucket {b} holds {_params(run)} but parameter {nxt}'s gradient arrives "
                    "first: buckets follow the reverse order of the parameters (backward makes the "
                    "last layer's gradients first)")
        if run != list(range(nxt, nxt - len(run), -1)):
            gap = next(i for i in range(nxt, nxt - len(run), -1) if i not in run)
            return (f"bucket {b} holds {_params(run)} but not parameter {gap}, whose gradient "
                    "arrives between them: a bucket is a contiguous run of parameters, in reverse "
                    "order")
        if bucket != run:
            return (f"bucket {b} lists {_params(bucket)}, but backward makes their gradients in "
                    f"the order {', '.join(map(str, run))}: a bucket fills, and lays its gradients "
                    "out in its buffer, in the order they arrive, so list each one last parameter "
                    "first (you sorted it, or walked forward inside it)")
        nxt -= len(run)
    for b, (mine, right) in enumerate(zip(got, want)):
        if len(mine) == len(right):
            continue
        held = sum(sizes[i] for i in mine)
        if len(mine) < len(right):
            nxt = min(mine) - 1
            return (f"bucket {b} closes after parameter {min(mine)} holding {held:,} bytes, below "
                    f"the cap of {cap:,}: a bucket stays open until it holds at least the cap "
                    f"(parameter {nxt}'s {sizes[nxt]:,} bytes belong in it too)")
        full = sum(sizes[i] for i in right)
        big = (
            " (a parameter larger than the cap is never split: it closes the bucket it lands in)"
            if len(right) == 1
            else ""
        )
        return (f"bucket {b} should close after parameter {min(right)}, once it holds {full:,} "
                f"bytes >= the cap of {cap:,}{big}; yours goes on to parameter {min(mine)} "
                f"({held:,} bytes)")
    return None


def _params(run: list[int]) -> str:
    return f"parameter {run[0]}" if len(run) == 1 else f"parameters {', '.join(map(str, run))}"


def _train(cfg: TrainConfig, buckets: list[list[int]], file: Path) -> float:
    """Train with the learner's buckets in the engine's Reducer;
    the largest relative gap to one device."""
    from dplab.backends import RankError

    sync = SyncConfig("ring", bucket_cap_mb=MODEL_CAP / 2**20)
    try:
        results = launch(_train_with_buckets, _WORLD, args=(cfg, sync, buckets), timeout=20)
    except RankError as e:
        raise rank_failure(e, file, f"training with your buckets {buckets}") from None
    oracle = train_single(cfg).params
    scale = float(np.abs(oracle).max())
    diff = max(float(np.abs(r.params - oracle).max()) for r in results) / scale
    if diff > _RTOL:
        raise Fail(f"training 3 steps on {_WORLD} ranks with your buckets {buckets} ends "
                   f"{diff:.1e} (relative) away from one device: every gradient must be summed "
                   "exactly once per step")
    return diff


def _train_with_buckets(comm: Any, cfg: TrainConfig, sync: SyncConfig,
                        buckets: list[list[int]]) -> TrainResult:
    """One rank of ``train_sync`` whose Reducer takes ``buckets`` instead of computing its own."""
    with mock.patch.object(engine, "assign_buckets", lambda *_: [list(b) for b in buckets]):
        return train_sync(comm, cfg, sync)
