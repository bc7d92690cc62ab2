"""Exercise of lesson 7: the stale-synchronous-parallel gate, written by the learner.

    dplab lesson check 7 DIR          # runs DIR/ssp_gate.py

The learner's ``may_proceed(clock, slowest, staleness)`` says whether a worker may start
``clock`` when the slowest worker has finished ``slowest`` clocks. It is judged against the
parameter server's own gate (``dplab.reference.ps.gate.gate_open``) on a grid of clocks and
staleness bounds, and by a real asynchronous run (a server and 3 workers, worker 1 slow) whose
server asks the learner's gate, answered from a table of its replies computed here. The
server's log records, for every gradient, the clock it was for and how many clocks the slowest
worker had finished when its pull was answered; SSP's promise is that the gap never exceeds
the staleness: "worker 2 ran 5 clocks ahead of the slowest with staleness 1".

Worker 1 is slow by the server's choice, not by a sleep: its pull is answered only once every
other worker waits at the gate or has finished. So the others always run as far ahead as the gate
lets them, and the run, its log and the verdict are the same at any load, whoever runs first.

A gate stricter than the server's could hold every worker forever, so the run happens only
when the learner's gate opens at least wherever the server's does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dplab.backends import RankError, launch
from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import (
    Fail,
    learner_call,
    load_function,
    rank_failure,
    short_repr,
)
from dplab.reference.ps.gate import Gate, gate_open
from dplab.reference.ps.protocol import AsyncConfig, LogEntry
from dplab.reference.ps.server import Server
from dplab.reference.ps.trainer import work
from dplab.reference.train.single import TrainConfig

__all__ = ["judge_ssp", "collect_ssp", "GRID_CLOCKS", "STALENESS", "RUN_STALENESS", "RUN_CLOCKS",
           "RUN_WORKERS", "HINTS", "MISTAKES"]

GRID_CLOCKS = range(9)
STALENESS = (0, 1, 2, 3, None)
RUN_STALENESS, RUN_CLOCKS, RUN_WORKERS = 1, 6, 3
SLOW_WORKER = 1  # the server answers it last: the others run as far ahead as the gate allows

HINTS = (
    "Staleness s bounds how far a worker may be AHEAD of the slowest: at clock c it is c - slowest "
    "clocks ahead. And None is no bound at all.",
    "A worker may start clock c once the slowest has finished enough clocks that c - slowest is at "
    "most s. Write that as a comparison of slowest with c - s; mind whether equality is allowed (s "
    "= 0 is lock-step: everyone starts clock 0 at once).",
    "return staleness is None or slowest >= clock - staleness",
)

# plausible wrong gates (what each does with staleness None: most check for it first), and what is
# wrong
MISTAKES: dict[str, tuple[Any, str]] = {
    "never_waits": (lambda c, d, s: True,
                    "your gate never makes anyone wait: every bound behaves like staleness=None, "
                    "inf on the command line (fully asynchronous)"),
    "one_loose": (lambda c, d, s: s is None or d >= c - s - 1,
                  "off by one, too loose: your gate lets a worker start clock c when the slowest "
                  "has finished c - s - 1 clocks, so it runs s + 1 clocks ahead; SSP's bound is s"),
    "one_strict": (lambda c, d, s: s is None or d > c - s,
                   "off by one, too strict: your gate holds a worker that is exactly s clocks "
                   "ahead, which SSP allows; with staleness 0 nobody could even start clock 0"),
    "reversed": (lambda c, d, s: s is None or d <= c - s,
                 "your comparison is reversed: it holds the workers close to the slowest and lets "
                 "the ones far ahead go"),
    "ignores_slowest": (lambda c, d, s: s is None or c <= s,
                        "your gate ignores the slowest worker: it compares the clock with the "
                        "staleness alone, so after clock s everyone waits forever"),
    "zero_unbounded": (lambda c, d, s: not s or d >= c - s,
                       "your gate treats staleness 0 as unbounded: `not staleness` is True for 0 "
                       "as well as for None, but 0 is lock-step (nobody starts clock c before the "
                       "slowest has finished c). Test `staleness is None`"),
    "none_lockstep": (lambda c, d, s: d >= c - (s or 0),
                      "staleness None means unbounded (nobody ever waits); your gate treats it as "
                      "0, lock-step"),
}


def judge_ssp(file: Path, output: list[str]) -> str:
    """The learner's may_proceed against the server's gate, then in a run of the parameter
    server."""
    keys = [
        (clock, slowest, s) for s in STALENESS for clock in GRID_CLOCKS for slowest in GRID_CLOCKS
    ]
    answer = run_learner("ssp_gate", file, {"keys": keys}, output)
    if answer["fail"]:
        raise Fail(answer["fail"])
    replies = {tuple(k): v for k, v in zip(keys, answer["data"].get("replies", []))}
    named = _named(replies)
    try:
        return _judge_replies(replies, file)
    except Fail as e:
        raise Fail(f"{e}. The mistake: {named}" if named else str(e)) from None


def _named(replies: dict[tuple, bool]) -> str:
    """The known mistake the replies match exactly, if any."""
    for gate, meaning in MISTAKES.values():
        if all(bool(gate(*k)) == v for k, v in replies.items()):
            return meaning
    return ""


def _judge_replies(replies: dict[tuple, bool], file: Path) -> str:
    strict = [k for k, v in replies.items() if not v and gate_open([k[1]], k[0], k[2])]
    loose = [k for k, v in replies.items() if v and not gate_open([k[1]], k[0], k[2])]
    if strict:
        clock, slowest, s = strict[0]
        rule = ("staleness None is fully asynchronous: nobody ever waits" if s is None else
                f"SSP lets a worker start clock {clock} once the slowest has finished {clock} - "
                f"{s} = {clock - s} clocks, and it has finished {slowest}")
        raise Fail(f"may_proceed(clock={clock}, slowest={slowest}, staleness={s}) is False, but "
                   f"{rule}: your gate holds back a worker that may go (too strict a gate can "
                   "stall the whole run)")
    table = {(c, d): replies[c, d, RUN_STALENESS] for c in GRID_CLOCKS for d in GRID_CLOCKS}
    log = _run(table, file)
    # the worst gap; among ties the earliest clock, then the lowest worker
    worst = max(log, key=lambda e: (e.clock - e.slowest_done, -e.clock, -e.worker))
    ahead = worst.clock - worst.slowest_done
    if ahead > RUN_STALENESS or loose:
        if ahead > RUN_STALENESS:
            said = (f"worker {worst.worker} ran {ahead} clocks ahead of the slowest with staleness "
                    f"{RUN_STALENESS}: it started clock {worst.clock} when the slowest had "
                    f"finished {worst.slowest_done}")
        else:  # this run's timing never met the case: the grid still shows it
            said = "this run's timing never put a worker that far ahead, but the grid does"
        clock, slowest, s = min(loose, key=lambda k: (k[2] != RUN_STALENESS, k[0] - k[1]))
        raise Fail(f"{said}; may_proceed(clock={clock}, slowest={slowest}, staleness={s}) is True, "
                   f"but with staleness {s} clock {clock} must wait until the slowest has finished "
                   f"{clock - s}")
    delay = max(e.delay for e in log)
    return (f"may_proceed agrees with the server's gate on all {len(replies)} cases, and in a run "
            f"of {RUN_WORKERS} workers (worker 1 slow) with staleness {RUN_STALENESS} no worker "
            f"ran more than {ahead} clock ahead of the slowest ({len(log)} updates; the largest "
            f"delay, in updates, was {delay})")


def collect_ssp(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: the learner's reply to each (clock, slowest, staleness), in
    ``out["replies"]``."""
    fn = load_function(file, "may_proceed")
    out["replies"] = replies = []
    for clock, slowest, s in inputs["keys"]:
        what = f"may_proceed(clock={clock}, slowest={slowest}, staleness={s})"
        try:
            with learner_call(file, what):
                got = fn(clock, slowest, s)
        except Fail as e:
            if s is None and "TypeError" in str(e):  # c - None: the unbounded case was not handled
                raise Fail(f"{e}: staleness None means unbounded, so test `staleness is None` "
                           "first and let the worker go") from None
            raise
        if not isinstance(got, (bool, np.bool_)):  # numpy's comparisons give np.bool_
            raise Fail(f"{what} returned {short_repr(got)}: return True (the worker may start) or "
                       "False (it waits)")
        replies.append(bool(got))


def _run(table: dict[tuple[int, int], bool], file: Path) -> list[LogEntry]:
    cfg = TrainConfig(steps=RUN_CLOCKS)
    acfg = AsyncConfig(staleness=RUN_STALENESS)
    try:
        return launch(_server_or_worker, RUN_WORKERS + 1, args=(cfg, acfg, table), timeout=20)[0]
    except RankError as e:
        raise rank_failure(e, file, "the run with your gate") from None


class _TableGate(Gate):
    """The server's gate, deciding with the learner's replies (``table[clock, slowest]``)."""

    def __init__(
        self, workers: int, staleness: int | None, table: dict[tuple[int, int], bool]
    ) -> None:
        super().__init__(workers, staleness)
        self.table = table

    def opens(self, clock: int) -> bool:
        live = self.live()
        return not live or self.table[clock, min(live)]


def _server_or_worker(comm: Any, cfg: TrainConfig, acfg: AsyncConfig,
                      table: dict[tuple[int, int], bool]) -> list[LogEntry]:
    """Rank 0: the engine's server with the learner's gate; the others: the engine's workers."""
    clocks = cfg.steps
    if comm.rank != 0:
        work(comm, cfg, acfg, clocks)
        return []
    server = _SlowLastServer(comm, cfg, acfg, clocks)
    server.gate = _TableGate(server.workers, acfg.staleness, table)
    return server.run()[1]


class _SlowLastServer(Server):
    """The engine's server, except that ``SLOW_WORKER``'s held pull is answered only when every
    other worker waits at the gate or has finished: the slowest worker by schedule, not by timing.
    It never deadlocks: once the others are held, the slowest worker's pull is one the gate opens
    for (the learner's gate opens wherever SSP's does, checked before the run)."""

    def release(self) -> None:
        slow = [(w, c) for w, c in self.waiting if w == SLOW_WORKER]
        self.waiting = [(w, c) for w, c in self.waiting if w != SLOW_WORKER]
        super().release()
        held = {w for w, _ in self.waiting}
        settled = all(w in held or w not in self.roster.active
                      for w in range(1, self.workers + 1) if w != SLOW_WORKER)
        self.waiting += slow
        if slow and settled:
            super().release()
