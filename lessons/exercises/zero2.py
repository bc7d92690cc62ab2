"""Exercise of lesson 10: one ZeRO-2 step, written by the learner.

    dplab lesson check 10 DIR         # runs DIR/zero2_step.py on local worlds of 1..4 ranks

The learner's ``zero2_step(comm, params, grad, optimizer)`` runs on every rank after its backward
pass: reduce-scatter the gradient, update the shard this rank owns with an optimizer that holds
state for that shard only, all-gather the parameters. Here each rank computes its shard of the
batch's gradient and calls it, 3 steps, on p = 1..4; after every step each rank's copy of every
shard is compared with one device (``train_single``, the oracle), and the first wrong one is
named in the lesson's words: "after step 0 rank 0 still holds shard 1 as it was before the step:
rank 1 updated it, but no all-gather brought the update to rank 0".
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dplab.backends import RankError, launch
from dplab.lessons.exercises.child import Patched, dplab_functions, patched_since, run_learner
from dplab.lessons.exercises.learner import (
    CheckUnavailable,
    Fail,
    TooLong,
    limit_s,
    load_function,
    rank_failure,
    same_process,
)
from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import DplabError
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, setup, train_single

__all__ = ["judge_zero2", "collect_zero2", "ShardOptimizer", "ShardError", "WORLD_SIZES", "STEPS"]

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 3
TIMEOUT_S = 10.0  # a collective that some rank never calls fails after this long, naming the rank
_RTOL = 1e-10  # float64 against one device: rounding only
# momentum, not Adam: Adam's step hardly changes when a gradient is p times too large
_CFG = TrainConfig(steps=STEPS, optimizer=OptimConfig("momentum", lr=0.05))


class ShardError(DplabError):
    """The learner stepped a rank's shard optimizer with something other than its shard."""


class ShardOptimizer:
    """Rank ``rank``'s optimizer: state for its own shard only, as ZeRO keeps it.

    ``step(params_shard, grad_shard)`` updates ``params_shard`` in place (a view such as
    ``params[a:b]``); anything but this rank's shard's length is refused with the reason."""

    def __init__(self, cfg: OptimConfig, num_params: int, rank: int, world_size: int,
                 dtype: np.dtype) -> None:
        self.rank, self.num_params = rank, num_params
        self.start, self.stop = chunk_bounds(num_params, world_size)[rank]
        self._opt = make_optimizer(cfg, self.stop - self.start, dtype)

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        size = self.stop - self.start
        if len(params) != size or len(grad) != size:
            raise ShardError(f"rank {self.rank}'s optimizer holds state for its own shard only: {size} of "
                             f"the {self.num_params} parameters (params[{self.start}:{self.stop}]), but step "
                             f"got {len(params)} parameters and {len(grad)} gradients: in ZeRO-2 a rank "
                             "updates only the chunk it owns, number rank of chunk_bounds(len(params), p)")
        self._opt.step(params, grad)


def judge_zero2(file: Path, output: list[str]) -> str:
    """The learner's zero2_step on 1..4 ranks, every rank's every shard against one device per step."""
    answer = run_learner("zero2_step", file, {"world_sizes": list(WORLD_SIZES)}, output)
    oracle = [train_single(replace(_CFG, steps=k)).params for k in range(STEPS + 1)]
    for p, plain in zip(WORLD_SIZES, answer["data"].get("runs", [])):
        runs = [[np.asarray(a, dtype=np.float64) for a in rank] for rank in plain]
        if len(runs) != p or any(len(r) != STEPS or any(a.shape != oracle[0].shape for a in r) for r in runs):
            raise Fail(f"at p={p}: the ranks did not bring back {STEPS} steps of {len(oracle[0])} parameters "
                       "each")
        problem = _diagnose(runs, oracle, p)
        if problem:
            raise Fail(f"at p={p}: {problem}")
    if answer["fail"]:
        raise Fail(answer["fail"])
    n, p = len(oracle[0]), WORLD_SIZES[-1]
    most = max(b - a for a, b in chunk_bounds(n, p))
    return (f"right on 1..{p} ranks: after each of {STEPS} steps every rank holds every shard as one device "
            f"has it, each rank keeping optimizer state for at most {most} of the {n} parameters at p={p}")


def collect_zero2(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: for each p, every rank's parameters after every step (``out["runs"]``).

    The ranks stop themselves a little before ``deadline``, so that the traceback names the
    learner's line; a rank that does not stop is killed with the child, by the parent."""
    load_function(file, "zero2_step")  # a file that does not import fails here, not on every rank
    out["runs"] = runs = []
    for p in inputs["world_sizes"]:
        try:
            done = launch(_rank, p, args=(str(file), _CFG, deadline), timeout=TIMEOUT_S)
        except TooLong as e:  # here, waiting for ranks that swallowed their own stop
            raise Fail(f"at p={p}: zero2_step {e}") from None
        except RankError as e:
            failure = rank_failure(e, file, "zero2_step")
            if isinstance(failure, CheckUnavailable):
                raise failure from None
            raise Fail(f"at p={p}: {failure}") from None
        patched = sorted({name for rank in done for name in rank["patched"]})
        if patched:
            raise Patched(patched)
        runs.append([[a.tolist() for a in rank["after"]] for rank in done])


def _rank(comm: Any, file: str, cfg: TrainConfig, deadline: float) -> dict[str, Any]:
    """One rank: its shard of each batch's gradient, the learner's step, the parameters after it."""
    left = deadline - time.monotonic()  # CLOCK_MONOTONIC: one clock for the child and its ranks
    signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, max(left - min(1.0, 0.2 * left), 0.01))
    before = dplab_functions()
    zero2_step = load_function(Path(file), "zero2_step")
    model, data, init = setup(cfg)
    params = comm.empty(model.num_params, init.dtype)
    params[:] = init
    grad = comm.empty(model.num_params, init.dtype)
    optimizer = ShardOptimizer(cfg.optimizer, model.num_params, comm.rank, comm.world_size, init.dtype)
    after = []
    for step in range(cfg.steps):
        batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        idx = shard(batch, comm.rank, comm.world_size)
        grad[:] = 0
        model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / cfg.global_batch, grad)
        with same_process():
            zero2_step(comm, params, grad, optimizer)
        after.append(np.array(params, copy=True))
    signal.setitimer(signal.ITIMER_REAL, 0)
    return {"after": after, "patched": patched_since(before, Path(file))}


def _stop(signum: int, frame: Any) -> None:
    raise TooLong(f"still running at the check's time limit of {limit_s():g} s: does a loop never end?")


def _diagnose(runs: list[list[np.ndarray]], oracle: list[np.ndarray], p: int) -> str | None:
    """The first (step, shard, rank) that differs from one device, said as what went wrong."""
    bounds = chunk_bounds(len(oracle[0]), p)
    scale = float(np.abs(oracle[-1]).max())
    for t in range(STEPS):
        want, before = oracle[t + 1], oracle[t]

        def close(x: np.ndarray, y: np.ndarray) -> bool:
            return bool(np.abs(x - y).max(initial=0.0) <= _RTOL * scale)

        for s, (a, b) in enumerate(bounds):  # first the owners: did each update its own shard right?
            got = runs[s][t][a:b]
            if not close(got, want[a:b]):
                return _wrong_update(t, s, a, b, got, want[a:b], before[a:b], p)
        for r in range(p):  # then the copies: did every owner's update reach every rank?
            for s, (a, b) in enumerate(bounds):
                got = runs[r][t][a:b]
                if close(got, want[a:b]):
                    continue
                if close(got, before[a:b]):
                    return (f"after step {t} rank {r} still holds shard {s} as it was before the step: "
                            f"rank {s} updated it, but no all-gather brought the update to rank {r}")
                return (f"after step {t} rank {r}'s copy of shard {s} differs from rank {s}'s, its owner, by "
                        f"{np.abs(got - want[a:b]).max():.3g}: the all-gather must copy each owner's shard "
                        "to every rank")
    return None


def _wrong_update(t: int, s: int, a: int, b: int, got: np.ndarray, want: np.ndarray, before: np.ndarray,
                  p: int) -> str:
    where = f"after step {t} rank {s}'s own shard {s} (params[{a}:{b}])"
    moved, right = got - before, want - before
    if not np.abs(moved).any():
        return (f"{where} did not move: rank {s} owns it and must update it in place "
                "(give optimizer.step views of params and grad, not copies: it changes them itself)")
    ratio = float(moved @ right / (right @ right)) if right.any() else float("nan")
    if p > 1 and abs(ratio * p - 1) < 1e-6:
        return (f"{where} moved 1/{p} as far as on one device: the gradient was averaged over the ranks, but "
                "every rank's loss is already scaled by 1/global batch, so the shards' gradients are summed")
    if p > 1 and abs(ratio / p - 1) < 1e-6:
        return f"{where} moved {p} times as far as on one device: was the gradient summed more than once?"
    return (f"{where} is off by {np.abs(got - want).max():.3g} from one device: rank {s} must step its "
            f"shard with the gradient summed over all ranks, which the reduce-scatter leaves in chunk {s} on "
            f"rank {s}")
