"""Exercise of lesson 8: one update with backup workers, the first n of N + b gradients.

    dplab lesson check 8 DIR          # runs DIR/backup_step.py

The learner's ``backup_step(arrivals, grads, n)`` returns the update (the mean of the first n
gradients to arrive, added in worker order) and the time the step ends (the n-th arrival). It is
judged on 200 cases (hand-made ties, no backups, one gradient, then random ones) against the
rule the parameter server's ``Aggregator`` follows; a wrong answer that matches a known mistake
is named ("your update averages all 4 gradients: plain synchronous SGD"). A right one is then
run on the lesson's simulated clock, to say what it buys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import Fail, learner_call, load_function, short_repr

__all__ = ["judge_backup", "collect_backup", "cases", "clock_arrivals", "HINTS", "MISTAKES",
           "right"]

HINTS = (
    "Which workers count is decided by when their gradients arrive, not by their numbers; how many "
    "count is n, whatever len(arrivals) is.",
    "Sort the workers by (arrival, worker) and keep the first n; the step ends at the arrival of "
    "the last one kept. The update is the mean of those n gradients: divide by n.",
    "first = sorted(range(len(arrivals)), key=lambda w: (arrivals[w], w))[:n]; add grads[w] for w "
    "in sorted(first) into a zero array (worker order: the same bits however they arrived), divide "
    "by n, and return it with arrivals[first[-1]].",
)
_SIZE = 5                                      # elements of each gradient


def cases(count: int = 200, seed: int = 7) -> list[tuple[list[float], list[list[float]], int]]:
    """(arrivals, grads, n): hand-made edge cases first, then random ones (ties from rounding)."""
    rng = np.random.default_rng(seed)
    hand = [([0.4, 0.1, 0.3, 0.2], 3),         # a backup: worker 0 is dropped
            ([0.1, 0.2, 0.2, 0.5], 2),         # a tie for second place: worker 1 before 2
            ([0.3, 0.1, 0.2], 3),              # no backups: everyone
            ([0.5, 0.2, 0.9, 0.1, 0.4], 1)]    # one gradient
    out = []
    for arrivals, n in hand:
        out.append((arrivals, rng.standard_normal((len(arrivals), _SIZE)).tolist(), n))
    while len(out) < count:
        w = int(rng.integers(2, 7))
        arrivals = np.round(rng.exponential(1.0, w), 1).tolist()
        out.append(
            (arrivals, rng.standard_normal((w, _SIZE)).tolist(), int(rng.integers(1, w + 1)))
        )
    return out


def clock_arrivals(steps: int = 2000, n: int = 8, b: int = 2) -> list[list[float]]:
    """The lesson's simulated clock (8.2): 1 unit plus a tail, 5% of steps 4x slower."""
    rng = np.random.default_rng(0)
    compute = 1 + 0.1 * rng.exponential(size=(steps, n + b))
    compute *= np.where(rng.random(compute.shape) < 0.05, 4, 1)
    return compute.tolist()


def _first(arrivals: list[float], n: int, tie_high: bool = False) -> list[int]:
    """The first n to arrive, in arrival order (ties: lower worker, or higher with tie_high)."""
    return sorted(range(len(arrivals)), key=lambda w: (arrivals[w], -w if tie_high else w))[:n]


def _mean(grads: list[list[float]], workers: list[int], divide: int) -> np.ndarray:
    total = np.zeros(_SIZE)
    for w in workers:
        total += np.asarray(grads[w])
    return total / divide


def right(arrivals: list[float], grads: list[list[float]], n: int) -> tuple[np.ndarray, float]:
    first = _first(arrivals, n)
    return _mean(grads, sorted(first), n), arrivals[first[-1]]


# name -> (update(arrivals, grads, n) or None where undefined, what it means)
MISTAKES: dict[str, tuple[Any, str]] = {
    "all": (
        lambda a, g, n: _mean(g, list(range(len(a))), len(a)),
        "your update averages all the gradients: that is plain synchronous SGD, which waits for "
        "the slowest worker; with backups the first n of the N + b gradients make the update and "
        "the b latecomers are dropped",
    ),
    "last": (
        lambda a, g, n: _mean(g, sorted(sorted(range(len(a)), key=lambda w: (a[w], w))[-n:]), n),
        "your update uses the LAST n gradients to arrive: the backups to drop are the slowest b, "
        "so the first n make the update",
    ),
    "by_number": (
        lambda a, g, n: _mean(g, list(range(n)), n),
        "your update uses workers 0..n-1 by number: which gradients count depends on when they "
        "arrive, not on who sent them",
    ),
    "divide_all": (
        lambda a, g, n: _mean(g, sorted(_first(a, n)), len(a)),
        "your update adds the right n gradients but divides by N + b, the number of "
        "workers: it is their mean, so divide by n (the dropped gradients are not zeros)",
    ),
    "one_more": (
        lambda a, g, n: _mean(g, sorted(_first(a, n + 1)), n + 1) if n < len(a) else None,
        "off by one: your update uses n + 1 gradients",
    ),
    "one_fewer": (
        lambda a, g, n: _mean(g, sorted(_first(a, n - 1)), n - 1) if n > 1 else None,
        "off by one: your update uses n - 1 gradients",
    ),
    "tie_high": (
        lambda a, g, n: _mean(g, sorted(_first(a, n, tie_high=True)), n),
        "with a tie for the n-th place your update takes the higher worker; the lower "
        "worker counts as first",
    ),
}
_T_MISTAKES = {
    "last": (lambda a, n: max(a), "t_end is when the LAST gradient arrives: that waits for "
                                  "everyone; the "
             "step ends when the n-th arrives"),
    "first": (lambda a, n: min(a), "t_end is when the FIRST gradient arrives; the step ends when "
                                   "the n-th "
              "arrives"),
    "by_number": (lambda a, n: max(a[:n]), "t_end is the last arrival among workers 0..n-1; the "
                                           "step ends "
                  "when the n-th gradient (by arrival) arrives"),
}


def judge_backup(file: Path, output: list[str]) -> str:
    """The learner's backup_step against the rule on 200 cases, then on the simulated clock."""
    tests = cases()
    clock = clock_arrivals()
    answer = run_learner("backup_step", file, {"cases": tests, "clock": clock, "needed": 8}, output)
    if answer["fail"]:
        raise Fail(answer["fail"])
    got = answer["data"]
    updates = [np.asarray(u, float) for u in got["updates"]]
    ends = got["ends"]
    truth = [right(*c) for c in tests]
    bad_u = [i for i, (u, (r, _)) in enumerate(zip(updates, truth))
             if not np.allclose(u, r, rtol=1e-12, atol=0)]
    bad_t = [i for i, (t, (_, r)) in enumerate(zip(ends, truth)) if t != r]
    if bad_u:
        raise Fail(_update_mistake(tests, updates, truth, bad_u[0]))
    if bad_t:
        raise Fail(_end_mistake(tests, ends, truth, bad_t[0]))
    order = [i for i, (u, (r, _)) in enumerate(zip(updates, truth)) if not np.array_equal(u, r)]
    if order:
        arrivals, _, n = tests[order[0]]
        raise Fail(f"for arrivals {arrivals} and n = {n} your update is right to rounding but not "
                   "bit for bit: add the n gradients in worker order (lowest first), not in the "
                   "order they arrived, so the same gradients always give the same bits (a replay "
                   "from the server's log relies on it)")
    mine = float(np.mean(got["clock_ends"]))
    waiting = float(np.mean([max(step[:8]) for step in clock]))  # N = 8 workers and no backup
    return (f"backup_step is right on all {len(tests)} cases (ties, no backups, one gradient, "
            "random ones): the first n by arrival, their mean in worker order, the step ending at "
            f"the n-th. On the lesson's simulated clock (N = 8, b = 2, {len(clock):,} steps) your "
            f"steps average {mine:.2f} units, against {waiting:.2f} for 8 workers without backups")


def _update_mistake(tests: list, updates: list[np.ndarray], truth: list, first_bad: int) -> str:
    arrivals, _, n = tests[first_bad]
    first = _first(arrivals, n)
    yours = short_repr(np.round(updates[first_bad], 4).tolist())
    said = (f"for arrivals {arrivals} and n = {n} your update is {yours}, "
            f"but the first {n} to arrive are workers {sorted(first)}, and their mean is "
            f"{short_repr(np.round(truth[first_bad][0], 4).tolist())}")
    for fn, meaning in MISTAKES.values():
        matched, differs = True, False
        for (a, g, k), u, (r, _) in zip(tests, updates, truth):
            wrong = fn(a, g, k)
            if wrong is None:
                continue
            if not np.allclose(u, wrong, rtol=1e-12, atol=0):
                matched = False
                break
            differs = differs or not np.allclose(wrong, r, rtol=1e-12, atol=0)
        if matched and differs:
            return f"{said}: {meaning}"
    return said


def _end_mistake(tests: list, ends: list[float], truth: list, first_bad: int) -> str:
    arrivals, _, n = tests[first_bad]
    said = (f"for arrivals {arrivals} and n = {n} your step ends at {short_repr(ends[first_bad])}, "
            f"but gradient number {n} to arrive comes at {truth[first_bad][1]}")
    for fn, meaning in _T_MISTAKES.values():
        if all(t == fn(a, k) for (a, _, k), t in zip(tests, ends)):
            return f"{said}: {meaning}"
    return said


def collect_backup(
    file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float
) -> None:
    """In the child: the learner's (update, t_end) for every case, and t_end on the simulated
    clock."""
    fn = load_function(file, "backup_step")
    out["updates"], out["ends"] = updates, ends = [], []
    for arrivals, grads, n in inputs["cases"]:
        what = f"backup_step(arrivals={arrivals}, grads=<{len(grads)} gradients>, n={n})"
        with learner_call(file, what):
            got = fn(list(arrivals), [np.asarray(g) for g in grads], n)
        update, t_end = _unpack(got, what)
        updates.append(update)
        ends.append(t_end)
    out["clock_ends"] = clock_ends = []
    zeros = [np.zeros(_SIZE) for _ in inputs["clock"][0]]
    for arrivals in inputs["clock"]:
        what = f"backup_step(arrivals=<{len(arrivals)} times>, n={inputs['needed']})"
        with learner_call(file, what):
            got = fn(list(arrivals), zeros, inputs["needed"])
        clock_ends.append(_unpack(got, what)[1])


def _unpack(got: Any, what: str) -> tuple[list[float], float]:
    try:
        update, t_end = got
        update = np.asarray(update, dtype=float)
        t_end = float(t_end)
    except (TypeError, ValueError):
        raise Fail(f"{what} returned {short_repr(got)}: return (update, t_end), a 1-D array of the "
                   "gradients' size and a number") from None
    if update.shape != (_SIZE,):
        raise Fail(f"{what} returned an update of shape {update.shape}: it is one gradient, shape "
                   f"({_SIZE},)")
    return update.tolist(), t_end
