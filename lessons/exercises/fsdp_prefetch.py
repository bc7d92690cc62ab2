"""Exercise of lesson 15: an FSDP forward that prefetches the next unit's all-gather.

    dplab lesson check 15 DIR         # runs DIR/fsdp_prefetch.py on a simulated DGX H100 node

The learner writes ``forward_units(n_units, gather, compute)``: run every unit in order, each with
its whole weights, starting the NEXT unit's all-gather before computing this one, so that the
gather runs on the comm thread while the device computes. The harness runs it on 4 ranks of the
simulated ``dgx-h100`` (virtual time: the same verdict at any load) and judges the properties,
not one way of writing it:

- every unit ran once, in order, with ITS weights, after ITS handle's wait (else its weights may
  be half gathered: the bug of waiting on the wrong handle);
- memory: when each unit ran, which units' gathered weights were still alive (weak references:
  what the learner's code still holds). At most two, this one and the next: a unit kept after it
  ran was never resharded, and gathering every unit up front holds the whole model;
- overlap: from the virtual clocks, how much of each gather (but the first) ran while the previous
  unit computed. A gather started after the previous compute, or waited for before it, hides
  nothing; the check wants at least half the gathers' time hidden.
"""

from __future__ import annotations

import gc
import itertools
import weakref
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
)
from dplab.reference.collectives import allgather
from dplab.reference.schedule import chunk_bounds
from dplab.reference.zero.overlap import CommThread

__all__ = ["judge_fsdp_prefetch", "collect_fsdp_prefetch", "HINTS", "WORLD", "UNITS", "CLUSTER",
           "COMPUTE_S", "HIDDEN_SHARE", "MOST_HELD", "overlap"]

WORLD, UNITS, UNIT_N = 4, 8, 4096  # float32 weights per unit: a gather of about 6 us on NVLink
CLUSTER = "dgx-h100"
COMPUTE_S = 10e-6  # a unit's forward on the device: longer than its gather, so all of it can hide
HIDDEN_SHARE = 0.5  # of the gathers' time after the first: less is no prefetch worth the name
MOST_HELD = 2  # units gathered at once: the one computing and the next
TIMEOUT_S = 20.0

HINTS = (
    "Before unit u computes, start gathering unit u + 1: gather returns at once, and the comm "
    "thread fills w while compute(u, w) keeps the device busy.",
    "w, h = gather(0); then for each u: h.wait() (unit u's OWN handle), start nxt = gather(u + 1) "
    "if there is one, compute(u, w), and drop w before taking the next pair.",
    "w, h = gather(0)\nfor u in range(n_units):\n    h.wait()\n    nxt = gather(u + 1) if u + 1 < "
    "n_units else None\n    compute(u, w)\n    del w\n    if nxt: w, h = nxt",
)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def judge_fsdp_prefetch(file: Path, output: list[str]) -> str:
    """The learner's forward_units on 4 simulated ranks: order, weights, memory held, overlap."""
    answer = run_learner("fsdp_prefetch", file, {}, output)
    if answer["fail"]:
        raise Fail(answer["fail"])
    run = answer["data"]["ranks"][0]  # every rank runs the same program on its own clock
    problem = next((r["problem"] for r in answer["data"]["ranks"] if r["problem"]), "")
    if problem:
        raise Fail(problem)
    computes, gathers = run["computes"], {int(u): g for u, g in run["gathers"].items()}
    first = computes[0]
    if first["issued"] >= UNITS > MOST_HELD:
        raise Fail(f"all {UNITS} units' gathers were started before unit 0 ran, so {UNITS} units' "
                   "whole weights were held at once: the whole model on every rank, which FSDP "
                   "exists to avoid. Prefetch only the next unit")
    for c in computes:
        u, held = c["unit"], c["held"]
        older = [v for v in held if v < u]
        if older:
            raise Fail(f"when unit {u} ran, unit {older[0]}'s gathered weights were still held "
                       f"({len(held)} units: {', '.join(map(str, held))}): never resharded. Once a "
                       f"unit "
                       "has run, drop its weights (del w), so that a rank holds its shards and at "
                       "most two units")
        if len(held) > MOST_HELD:
            raise Fail(f"when unit {u} ran, {len(held)} units were gathered "
                       f"({', '.join(map(str, held))}): prefetch only the next unit, so that at "
                       f"most {MOST_HELD} are held at once")
    for v in range(1, UNITS):
        g = gathers[v]
        if g["computed_before_issue"] >= v:
            raise Fail(f"unit {v}'s gather was started only after unit {v - 1} had run, so nothing "
                       f"overlapped it: start gather({v}) before compute({v - 1}) (prefetch)")
        if g["computed_before_wait"] < v:
            raise Fail(f"unit {v}'s gather was waited for before unit {v - 1} ran: wait() blocks "
                       f"until the gather is done, so nothing overlapped it. Wait just before unit "
                       f"{v} computes")
    hidden = sum(overlap((gathers[v]["start"], gathers[v]["end"]),
                         (computes[v - 1]["start"], computes[v - 1]["end"]))
                 for v in range(1, UNITS))
    spent = sum(gathers[v]["end"] - gathers[v]["start"] for v in range(1, UNITS))
    share = hidden / spent if spent else 0.0
    if share < HIDDEN_SHARE:
        raise Fail(f"only {share:.0%} of the gathers' time (after the first) ran under the "
                   f"previous unit's compute, on the simulated {CLUSTER}: start each gather before "
                   f"the compute "
                   "it should hide behind, and wait for it only when its unit is next")
    serial = sum(g["end"] - g["start"] for g in gathers.values()) + sum(c["end"] - c["start"]
                                                                        for c in computes)
    return (f"right: on {WORLD} simulated H100s ({CLUSTER}) {share:.0%} of the gathers' time after "
            f"the first ran under the previous unit's compute; the forward took "
            f"{run['total'] * 1e6:.0f} us against {serial * 1e6:.0f} us one after another, with "
            f"every unit run on its own whole weights and at most "
            f"{max(len(c['held']) for c in computes)} units gathered at once")


def collect_fsdp_prefetch(file: Path, inputs: dict[str, Any], out: dict[str, Any],
                          deadline: float) -> None:
    """In the child: every rank's computes, gathers, waits and first problem, on virtual time."""
    load_function(file, "forward_units")
    try:
        done = launch(_rank, WORLD, backend="sim", cluster=CLUSTER, args=(str(file),),
                      timeout=TIMEOUT_S)
    except TooLong:
        raise
    except RankError as e:
        failure = rank_failure(e, file, "forward_units")
        if isinstance(failure, CheckUnavailable):
            raise failure from None
        raise Fail(str(failure)) from None
    patched = sorted({name for rank in done for name in rank.pop("patched")})
    if patched:
        raise Patched(patched)
    out["ranks"] = done


class _Handle:
    """What gather returns beside w: ``wait()`` blocks until unit ``unit``'s gather is done."""

    def __init__(self, unit: int, inner: Any, log: _Log) -> None:
        self.unit, self._inner, self._log = unit, inner, log

    def wait(self) -> None:
        self._log.waited(self.unit)
        self._inner.wait()


class _Log:
    """One rank's record of the learner's calls, on its virtual clock."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.problem = comm, ""
        p, r = comm.world_size, comm.rank
        rng = np.random.default_rng(31)
        self.weights = [rng.standard_normal(UNIT_N).astype(np.float32) for _ in range(UNITS)]
        self.own = chunk_bounds(UNIT_N, p)[r]
        self.thread = CommThread(comm)
        self.live: dict[int, int] = {}  # buffer key -> unit, while the learner's code holds it
        self.bufs: dict[int, weakref.ref] = {}  # unit -> its gathered buffer
        self.keys = itertools.count()
        self.gathers: dict[int, dict[str, Any]] = {}
        self.computes: list[dict[str, Any]] = []
        self.waits: set[int] = set()
        self.last_wait: int | None = None

    def fail(self, text: str) -> None:
        self.problem = self.problem or text

    def waited(self, unit: int) -> None:
        self.waits.add(unit)
        self.last_wait = unit
        self.gathers[unit].setdefault("computed_before_wait", len(self.computes))

    def gather(self, u: Any) -> tuple[np.ndarray, _Handle]:
        if not isinstance(u, (int, np.integer)) or not 0 <= u < UNITS or int(u) in self.gathers:
            self.fail(f"gather({u!r}) was called: gather each unit 0..{UNITS - 1} once, as it is "
                      f"next")
            raise _Stop
        u = int(u)
        a, b = self.own
        w = np.zeros(UNIT_N, np.float32)
        w[a:b] = self.weights[u][a:b]  # my chunk in place; the all-gather brings the others'
        key = next(self.keys)
        self.live[key] = u
        weakref.finalize(w, self.live.pop, key, None)
        self.bufs[u] = weakref.ref(w)
        record = self.gathers[u] = {"issued": self.comm.now(),
                                    "computed_before_issue": len(self.computes)}

        def run(buf: np.ndarray = w) -> None:
            record["start"] = self.comm.now()
            allgather(self.comm, buf, "ring")
            record["end"] = self.comm.now()

        return w, _Handle(u, self.thread.submit(run), self)

    def compute(self, u: Any, w: Any) -> None:
        expected = len(self.computes)
        if u != expected:
            self.fail(f"compute({u!r}, w) was called when unit {expected} was next: run the units "
                      f"0..{UNITS - 1} in order, each once")
            raise _Stop
        owner = next((v for v, ref in self.bufs.items() if ref() is w), None)
        if owner is None:
            self.fail(f"compute({u}, w) was given an array that no gather returned: pass the w "
                      f"that gather({u}) returned")
            raise _Stop
        if owner != u:
            self.fail(f"unit {u} ran with unit {owner}'s weights: compute(u, w) needs the w of "
                      f"gather(u)")
            raise _Stop
        if u not in self.waits:
            last = self.last_wait
            other = f" (the last wait was unit {last}'s)" if last is not None else ""
            self.fail(f"unit {u} ran before its own gather's handle was waited for{other}: its "
                      f"weights may be half gathered. Wait on unit {u}'s handle before "
                      f"compute({u}, w)")
            raise _Stop
        if not np.array_equal(w, self.weights[u]):
            self.fail(f"unit {u}'s weights were not whole when it ran: did something write into w?")
            raise _Stop
        held = sorted(self.live.values())
        if len(held) > 1 and held != [u, u + 1]:
            gc.collect()  # a cycle of the learner's own is not a reference it holds
            held = sorted(self.live.values())
        start = self.comm.now()
        self.comm.work(COMPUTE_S)
        self.computes.append({"unit": u, "start": start, "end": self.comm.now(), "held": held,
                              "issued": len(self.gathers)})


class _Stop(Exception):
    """The first wrong call ends the learner's run: its verdict is already written."""


def _rank(comm: Any, file: str) -> dict[str, Any]:
    before = dplab_functions()
    forward_units = load_function(Path(file), "forward_units")
    log = _Log(comm)
    t0 = comm.now()
    try:
        forward_units(UNITS, log.gather, log.compute)
    except _Stop:
        pass
    finally:
        for record in log.gathers.values():
            record.setdefault("computed_before_wait", UNITS)
        log.thread.close()
    total = comm.now() - t0
    if not log.problem and len(log.computes) < UNITS:
        log.fail(f"forward_units returned after {len(log.computes)} of the {UNITS} units had run: "
                 "compute every unit")
    if not log.problem and any("end" not in g for g in log.gathers.values()):
        log.fail("a gather was started and never waited for")
    return {"problem": log.problem, "computes": log.computes, "total": total,
            "gathers": {str(u): g for u, g in log.gathers.items()},
            "patched": patched_since(before, Path(file))}
