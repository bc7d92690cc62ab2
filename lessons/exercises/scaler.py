"""Exercise of lesson 11: the dynamic loss scaler's rule, written by the learner.

    dplab lesson check 11 DIR         # runs DIR/loss_scaler.py

The learner's ``update(scale, good_steps, found_inf, growth_factor, backoff_factor,
growth_interval)`` returns ``(new_scale, new_good_steps, take_step)`` after one step's overflow
check. It is run, in the child, through scripted runs (overflow flags given) and runs whose
overflows come from the scale itself (a gradient whose largest entry is ``gmax`` overflows
float16 once ``gmax * scale`` is past 65,504), and held to the engine's own ``LossScaler``
(``reference/precision/scaler.py``, torch's GradScaler rules) step by step. The verdict names the
first step where they part, as what went wrong: "step 3 overflowed but your rule takes the step",
"after an overflow at S = 1,024 the scale stayed 1,024: it must back off to 512", "the scale grew
after 2 clean steps since the last overflow, but growth_interval is 3: the count restarts at 0
after an overflow".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import Fail, learner_call, load_function, short_repr
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.precision.scaler import LossScaler

__all__ = ["judge_scaler", "collect_scaler", "overflows", "RUNS", "HINTS", "FP16_MAX"]

FP16_MAX = 65504.0
# (name, init_scale, growth_interval, flags or None, gmax, steps): flags script the overflows; with
# None, a step overflows when gmax * scale is past float16's largest value
RUNS = [
    ("clean steps", 1024.0, 3, [False] * 7, 0.0, 7),
    ("an overflow, then clean steps", 1024.0, 3, [True, False, False, True] + [False] * 4, 0.0, 8),
    ("overflows in a row", 2.0**20, 3, [True] * 4 + [False] * 4, 0.0, 8),
    (
        "an overflow just before growth",
        256.0,
        3,
        [False, False, True, False, False, False, False],
        0.0,
        7,
    ),
    ("too large a scale, found by overflowing", 2.0**24, 4, None, 0.5, 40),
    ("GradScaler's defaults, 4,100 steps", 2.0**16, 2000, None, 1e-4, 4100),
]

HINTS = (
    "Two cases. An overflow: the gradient holds inf or nan, so the step must not be taken, and the "
    "scale was too large. No overflow: the step is taken, and after enough of those in a row the "
    "scale may try to grow.",
    "On an overflow: return (scale * backoff_factor, 0, False): skip, back off, and start counting "
    "clean steps afresh. Otherwise count this clean step: good_steps + 1.",
    "Without an overflow: good = good_steps + 1; if good == growth_interval: return (scale * "
    "growth_factor, 0, True); else return (scale, good, True).",
)


def overflows(x: float) -> bool:
    """Whether ``x`` overflows float16 when cast (the checker's own cast: numpy's warning about it
    would land in what the learner's code printed)."""
    with np.errstate(over="ignore"):
        return not math.isfinite(float(np.float16(x)))


def collect_scaler(
    file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float
) -> None:
    """In the child: every call of the learner's update along every run (``out["runs"]``)."""
    update = load_function(file, "update")
    out["runs"] = runs = []
    for _name, init, interval, flags, gmax, steps in inputs["runs"]:
        scale, good, calls = float(init), 0, []
        for step in range(steps):
            found = bool(flags[step]) if flags is not None else overflows(gmax * scale)
            what = f"update(scale={scale:g}, good_steps={good!r}, found_inf={found}, ...)"
            with learner_call(file, what):
                got = update(scale, good, found, 2.0, 0.5, interval)
            if not (isinstance(got, tuple) and len(got) == 3):
                raise Fail(f"{what} returned {short_repr(got)}: return three things, (new_scale, "
                           "new_good_steps, take_step)")
            new_scale, good, take = got
            try:
                new_scale = float(new_scale)
            except (TypeError, ValueError):
                raise Fail(f"{what} returned the scale {short_repr(new_scale)}: it must be a "
                           "number") from None
            if not isinstance(take, (bool, np.bool_)):
                raise Fail(f"{what} returned take_step={short_repr(take)}: return True (take the "
                           "step) or False (skip it)")
            calls.append([scale, found, new_scale, bool(take)])
            scale = new_scale
        runs.append(calls)


def judge_scaler(file: Path, output: list[str]) -> str:
    """The learner's rule against LossScaler.update, step by step, on every run of RUNS."""
    answer = run_learner("loss_scaler", file, {"runs": [list(r) for r in RUNS]}, output)
    if answer["fail"]:
        raise Fail(answer["fail"])
    skipped = grown = 0
    for (name, init, interval, _flags, _gmax, steps), calls in zip(
        RUNS, answer["data"].get("runs", [])
    ):
        if len(calls) != steps:
            raise Fail(f"{name}: the run stopped after {len(calls)} of {steps} steps")
        oracle = LossScaler(MixedPrecision(init_scale=init, growth_interval=interval))
        since, last = 0, "the start"  # clean steps since the last overflow or growth
        for step, (scale, found, new_scale, take) in enumerate(calls):
            want_take = oracle.update(found, step)
            want = oracle.loss_scale
            problem = _wrong(
                step, scale, found, new_scale, take, want, want_take, since, last, interval
            )
            if problem:
                raise Fail(f"{name} (growth_interval {interval}): {problem}")
            skipped += not want_take
            grown += want > scale
            if found or want > scale:
                since, last = 0, "an overflow" if found else "a growth"
            else:
                since += 1
    return (f"right on {len(RUNS)} runs: every step your rule skips, backs off and grows as "
            f"torch's GradScaler does ({skipped} steps skipped, {grown} growths, GradScaler's "
            "defaults included)")


def _wrong(step: int, scale: float, found: bool, new_scale: float, take: bool, want: float,
           want_take: bool, since: int, last: str, interval: int) -> str | None:
    """What the learner's step did that the rule does not, in the lesson's words (None: the
    same)."""
    at = f"step {step} (S = {scale:,.6g})"
    if found and take:
        return (f"{at} overflowed, but your rule takes the step: the gradient holds inf or nan, "
                "and one such update ruins the weights; skip it")
    if not found and not take:
        return f"{at} had no overflow, but your rule skips it: only an overflow skips a step"
    if new_scale == want:
        return None
    if found:
        if new_scale == scale:
            return (f"after the overflow at {at} the scale stayed {scale:,.6g}: it must back off "
                    f"to {want:,.6g} (x backoff_factor), or the next step overflows again")
        if new_scale > scale:
            return (f"after the overflow at {at} the scale grew to {new_scale:,.6g}: "
                    "an overflow backs off")
        return (f"after the overflow at {at} the scale became {new_scale:,.6g}, not {want:,.6g} "
                "(x backoff_factor)")
    if want > scale:
        return (f"the scale should grow at {at}, clean step {interval} in a row since {last}, to "
                f"{want:,.6g} (x growth_factor); yours stayed {new_scale:,.6g}")
    if new_scale > scale:
        why = {"an overflow": ": the count of clean steps restarts at 0 after an overflow",
               "a growth": ": the count restarts at 0 after each growth"}.get(last, "")
        steps = f"{since + 1} clean step{'s' if since else ''}"
        return (f"the scale grew at {at}, after {steps} since {last}, but growth_interval is "
                f"{interval}{why}")
    return (f"at {at} the scale became {new_scale:,.6g}; "
            f"with no overflow it stays {want:,.6g} until it grows")
