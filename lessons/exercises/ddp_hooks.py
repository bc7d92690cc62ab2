"""Exercise of lesson 15: DDP from hooks on torch tensors (CS336's exercise), judged on two gloo
ranks.

    dplab lesson check 15 DIR         # runs DIR/ddp_hooks.py

The learner's ``attach_ddp_hooks(model)`` registers a post-accumulate-grad hook on every
trainable parameter that launches an asynchronous ``torch.distributed.all_reduce`` of its
gradient the moment backward has finished it, and returns ``finish()``, which waits for every
launched all-reduce; the loop calls it after ``loss.backward()`` and before ``opt.step()``.

Two forked ranks of dplab's torch backend (gloo) train a small float64 MLP for a few SGD steps,
each on its half of every batch. In each rank the checker wraps ``torch.distributed.all_reduce``
to log what was reduced (a gradient, a parameter's values, some other tensor), whether it was
asynchronous, how many other gradients backward had still to make when it started (counted by the
checker's own hooks, registered after the learner's: the overlap), and when each wait came (inside
backward, in ``finish``, never). The verdict reads that log first (the mistakes that still train
right: launching after backward or all from the last hook, waiting before launching the next, never
waiting), then the parameters against one process on the whole batch (the oracle), and says
what went wrong in the lesson's words: "moved 2 times as far as one process: the gradients were
summed, not averaged".
"""

from __future__ import annotations

import base64
import signal
from pathlib import Path
from typing import Any

import numpy as np

from dplab.backends import RankError, launch
from dplab.lessons.exercises.child import (
    Patched,
    dplab_functions,
    patched_since,
    run_learner,
)
from dplab.lessons.exercises.learner import (
    CheckUnavailable,
    Fail,
    TooLong,
    load_function,
    rank_failure,
    same_process,
)
from dplab.lessons.exercises.ranks import stop_before

__all__ = ["judge_ddp_hooks", "collect_ddp_hooks", "make_model", "data", "train_one_process",
           "WORLD", "STEPS", "HINTS", "sgd_step"]

WORLD = 2
STEPS = 3
ROWS = 8          # the global batch; each rank takes half
LR = 0.1
TIMEOUT_S = 20.0  # an all-reduce that one rank never calls fails after this long
_RTOL = 1e-10     # float64 against one process: rounding only

HINTS = (
    "A post-accumulate-grad hook gets the parameter once its .grad is complete for this backward: "
    "that is the moment its all-reduce can start, while backward goes on with earlier layers.",
    "In the hook: dist.all_reduce(param.grad, async_op=True) returns a work handle; keep it. "
    "all_reduce sums, and each rank's loss is the mean over its own half: divide by the world "
    "size.",
    "finish() calls .wait() on every handle the hooks kept, then forgets them (the next backward "
    "launches new ones). Do not wait inside the hook: that waits for each all-reduce before the "
    "next can be launched.",
)


def make_model() -> Any:
    """The same float64 MLP on every rank (seeded): three layers, six parameter tensors."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2)).double()


def data(step: int) -> tuple[Any, Any]:
    """The global batch of ``step`` (the same on every rank)."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :2]) + 0.1 * x[:, 2:4]


def train_one_process() -> list[np.ndarray]:
    """The oracle: one process, the whole batch, plain SGD; the flat parameters after each step."""
    import torch

    model = make_model()
    out = [_flat(model)]
    for step in range(STEPS):
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sgd_step(model)
        out.append(_flat(model))
    return out


def sgd_step(model: Any) -> None:
    """Plain SGD by hand, then the gradients dropped (torch.optim's first use imports for
    seconds)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def _flat(model: Any) -> np.ndarray:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


# --- in the child: the learner's hooks on two gloo ranks ------------------------------------------

def collect_ddp_hooks(
    file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float
) -> None:
    """In the child: every rank's parameters after each step, and its log of all-reduces and
    waits."""
    # a file that does not import fails here, not on every rank
    load_function(file, "attach_ddp_hooks")
    try:
        done = launch(_rank, WORLD, backend="torch", args=(str(file), deadline), timeout=TIMEOUT_S)
    except TooLong as e:
        raise Fail(f"attach_ddp_hooks {e}") from None
    except RankError as e:
        failure = rank_failure(e, file, "training with your hooks")
        if isinstance(failure, CheckUnavailable):
            raise failure from None
        raise failure from None
    patched = sorted({name for rank in done for name in rank["patched"]})
    if patched:
        raise Patched(patched)
    out["ranks"] = [{"after": [base64.b64encode(a.tobytes()).decode() for a in rank["after"]],
                     "log": rank["log"], "names": rank["names"]} for rank in done]


class _Recorder:
    """Wraps ``torch.distributed.all_reduce``: logs each call and each wait, in the phase it came
    in."""

    def __init__(self, real: Any, params: list[Any]) -> None:
        self.real, self.params, self.log = real, params, []
        self.phase, self.step = "attach", -1
        self.ready = 0   # gradients backward has finished this step (the checker's own hooks count)

    def made(self, param: Any) -> None:
        """A post-accumulate-grad hook of the checker's, registered after the learner's:
        it fires once the learner's hook for the same parameter has run."""
        self.ready += 1

    def what(self, tensor: Any) -> tuple[str, int]:
        ptr = tensor.data_ptr()
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad.data_ptr() == ptr:
                return "grad", i
            if p.data_ptr() == ptr:
                return "param", i
        return "other", -1

    def all_reduce(self, tensor: Any, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        kind, i = self.what(tensor)
        call = len(self.log)
        # the overlap: how many other gradients backward had still to make when this one started
        to_come = len(self.params) - self.ready - (1 if self.phase == "backward" else 0)
        self.log.append(
            {
                "event": "launch",
                "step": self.step,
                "phase": self.phase,
                "what": kind,
                "index": i,
                "async": bool(async_op),
                "call": call,
                "to_come": max(to_come, 0),
            }
        )
        work = self.real(tensor, *args, async_op=async_op, **kwargs)
        return _Work(work, self, call) if async_op and work is not None else work


class _Work:
    """A work handle that logs its ``wait``; everything else is the real handle's."""

    def __init__(self, work: Any, recorder: _Recorder, call: int) -> None:
        self._work, self._recorder, self._call = work, recorder, call

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        r = self._recorder
        r.log.append({"event": "wait", "step": r.step, "phase": r.phase, "call": self._call})
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _rank(comm: Any, file: str, deadline: float) -> dict[str, Any]:
    """One rank: the learner's hooks on the MLP, ``STEPS`` SGD steps on its half of each batch."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    stop_before(deadline, "does a loop never end, or does a rank wait for an all-reduce the other "
                          "never launched?")
    torch.set_num_threads(1)
    before = dplab_functions()
    model = make_model()
    params = list(model.parameters())
    recorder = _Recorder(dist.all_reduce, params)
    # the learner calls this one
    dist.all_reduce = distributed_c10d.all_reduce = recorder.all_reduce
    attach = load_function(Path(file), "attach_ddp_hooks")
    with same_process():
        finish = attach(model)
    for p in params:   # after the learner's: they count the gradients backward has finished
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(recorder.made)
    if not callable(finish):
        raise Fail(f"attach_ddp_hooks returned {type(finish).__name__}, not a function: return "
                   "finish, which the loop calls after loss.backward() to wait for the all-reduces")
    half = slice(comm.rank * ROWS // WORLD, (comm.rank + 1) * ROWS // WORLD)
    after = []
    for step in range(STEPS):
        recorder.step, recorder.ready = step, 0
        x, y = data(step)
        recorder.phase = "backward"
        with same_process():
            # the mean over my half
            torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
            recorder.phase = "finish"
            finish()
        recorder.phase = "step"
        sgd_step(model)
        after.append(_flat(model))
    signal.setitimer(signal.ITIMER_REAL, 0)
    names = [f"{name} {tuple(p.shape)}" for name, p in model.named_parameters()]
    return {
        "after": after,
        "log": recorder.log,
        "names": names,
        "patched": patched_since(before, Path(file)),
    }


# --- in the parent: the verdict -------------------------------------------------------------------

def judge_ddp_hooks(file: Path, output: list[str]) -> str:
    """The learner's hooks: the all-reduce log first, then the values against one process."""
    answer = run_learner("ddp_hooks", file, {}, output)
    if answer["fail"]:
        raise Fail(answer["fail"])
    ranks = answer["data"].get("ranks", [])
    if len(ranks) != WORLD:
        raise Fail(f"the {WORLD} ranks did not all come back")
    names = ranks[0]["names"]
    problem = _read_log(ranks[0]["log"], names)
    if problem:
        raise Fail(problem)
    overlapped, launched = _overlap(ranks[0]["log"])
    oracle = train_one_process()
    runs = [
        [np.frombuffer(base64.b64decode(a), dtype=np.float64) for a in rank["after"]]
        for rank in ranks
    ]
    problem = _diagnose(runs, oracle, names)
    if problem:
        raise Fail(problem)
    return (f"right: on {WORLD} gloo ranks every parameter's gradient was all-reduced from its "
            f"hook while backward ran ({overlapped} of the {launched} all-reduces started while "
            "backward still had gradients to make), waited for in finish(), and after each of "
            f"{STEPS} steps both ranks hold one process's parameters (within {_RTOL:g})")


def _overlap(log: list[dict[str, Any]]) -> tuple[int, int]:
    """(all-reduces started while backward still had other gradients to make, all launched), rank
    0."""
    launches = [e for e in log if e["event"] == "launch"]
    return sum(e["phase"] == "backward" and e["to_come"] > 0 for e in launches), len(launches)


def _read_log(log: list[dict[str, Any]], names: list[str]) -> str | None:
    """The mistakes the log shows, in the order a learner makes them."""
    launches = [e for e in log if e["event"] == "launch"]
    if not launches:
        return (
            "no all-reduce was launched: each rank stepped on the gradient of its own half alone, "
            "so the replicas drift apart. In the hook, call dist.all_reduce(param.grad, "
            "async_op=True)"
        )
    for e in launches:
        if e["what"] == "param":
            return (f"you all-reduced {names[e['index']]}'s values (param.data), not its gradient "
                    "(param.grad): the replicas' weights are equal already; it is the gradients of "
                    "the two halves that must be summed, before the optimizer steps")
        if e["what"] == "other":
            return ("you all-reduced a tensor that is not any parameter's .grad (a copy, e.g. "
                    "param.grad.clone() or param.grad * 1): the sum lands in the copy while "
                    "param.grad, which the optimizer reads, keeps this rank's own gradient. "
                    "All-reduce param.grad itself: it works in place")
    for step in range(max(e["step"] for e in launches) + 1):
        mine = [e for e in launches if e["step"] == step]
        counts: dict[int, int] = {}
        for e in mine:
            counts[e["index"]] = counts.get(e["index"], 0) + 1
        missing = [i for i in range(len(names)) if i not in counts]
        if missing:
            return (f"in step {step} {names[missing[0]]}'s gradient was never all-reduced "
                    f"({len(missing)} of {len(names)} parameters were not): that parameter stays "
                    "at its own rank's gradient and the replicas drift apart. Register the hook on "
                    "every parameter with requires_grad")
        twice = [i for i, n in counts.items() if n > 1]
        if twice:
            return (f"in step {step} {names[twice[0]]}'s gradient was all-reduced "
                    f"{counts[twice[0]]} times: each all-reduce sums the ranks again. One "
                    "all-reduce per parameter per backward")
        if any(not e["async"] for e in mine):
            return ("the all-reduces were blocking (async_op=False): each one finished before "
                    "backward could go on, so no communication overlapped the backward still "
                    "running. Launch with async_op=True in the hook, keep the handle, and wait in "
                    "finish()")
        late = [e for e in mine if e["phase"] != "backward"]
        if late:
            return (f"in step {step} {len(late)} of the {len(mine)} all-reduces were launched in "
                    "finish(), after backward had ended: none of that communication overlapped "
                    "backward. Launch each from its parameter's hook, the moment its gradient is "
                    "ready")
        if not any(e["to_come"] for e in mine):
            return (f"in step {step} every all-reduce started after backward had made the last "
                    f"gradient (0 of {len(mine)} started while other gradients were still to "
                    "come): the hooks waited for the last one and launched them all together, so "
                    "nothing overlapped backward. Launch each from its own parameter's hook, as "
                    "soon as that gradient is ready")
        calls = {e["call"] for e in mine}
        waits = [e for e in log if e["event"] == "wait" and e["call"] in calls]
        early = [e for e in waits if e["phase"] == "backward"]
        if early:
            return ("you waited for each all-reduce inside its hook, before the next one was "
                    "launched: the all-reduces ran one at a time and backward stood still during "
                    "each, which is a blocking all-reduce with extra steps. Keep the handles and "
                    "wait for all of them in finish()")
        waited = {e["call"] for e in waits if e["phase"] == "finish"}
        if waited != calls:
            return (f"finish() waited for {len(waited)} of the {len(calls)} all-reduces launched "
                    f"in step {step}: opt.step() may read a gradient that is still being summed "
                    "(gloo happened to be done here; NCCL on a GPU would not be). Wait for every "
                    "handle in finish()")
    return None


def _diagnose(
    runs: list[list[np.ndarray]], oracle: list[np.ndarray], names: list[str]
) -> str | None:
    scale = float(np.abs(oracle[-1]).max())
    for t in range(STEPS):
        want, before = oracle[t + 1], oracle[t]
        for r, run in enumerate(runs):
            got = run[t]
            if np.abs(got - want).max() <= _RTOL * scale:
                continue
            moved, right = got - before, want - before
            ratio = float(moved @ right / (right @ right)) if right.any() else float("nan")
            where = f"after step {t} rank {r}'s parameters"
            if abs(ratio - WORLD) < 1e-6:
                return (f"{where} moved {WORLD} times as far as one process's: the gradients were "
                        "summed, not averaged. all_reduce sums, and each rank's loss is already "
                        "the mean over its own half: divide each gradient by the world size "
                        f"({WORLD})")
            if abs(ratio * WORLD - 1) < 1e-6:
                return (f"{where} moved 1/{WORLD} as far as one process's: the gradient was "
                        "divided by the world size twice (before and after the all-reduce?)")
            return (f"{where} differ from one process's by {np.abs(got - want).max():.3g}: each "
                    "rank must step on the average of the two halves' gradients")
    return None
