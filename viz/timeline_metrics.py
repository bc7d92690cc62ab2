"""Where a real run's time went, per rank: compute, communication, how much of it was hidden.

The Runs page's numbers, computed from the trace events by interval arithmetic on ``[start, end)``
spans in nanoseconds: unions of a rank's compute and communication spans and their intersection.
Spans nest (a bucket holds its all-reduce, a straggler's sleeps sit inside ``backward``), so
every total is the measure of a union: nothing is counted twice.

    compute:  [ forward ][ backward ..........]           [opt]
    comm:                    [ bucket 0 ][ bucket 1 ..........]
    overlap:                 [ ........ ]                          exposed: [......]

    from dplab.backends.runs.run import RunSpec, run_train
    from dplab.viz.timeline_metrics import rank_stats, find_straggler
    row, per_rank = run_train(RunSpec(world_size=4, straggler=((1, 4.0),)), trace=True)
    stats = rank_stats([e for events in per_rank for e in events])
    find_straggler(stats, configured=(1,)).sentence     # "rank 1 is the straggler: ..."
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dplab.reference.trace import Event
from dplab.reference.trace_metrics import (  # interval arithmetic, span kinds: shared with scaling
    COMM_KINDS,
    COMPUTE_KINDS,
    WAIT_KINDS,
    Interval,
    intersect,
    measure,
    subtract,
    union,
)

__all__ = ["Interval", "union", "measure", "intersect", "subtract", "COMPUTE_KINDS", "COMM_KINDS",
           "WAIT_KINDS", "RankStats", "rank_stats", "totals", "Straggler", "find_straggler",
           "STRAGGLER_RATIO", "configured_stragglers"]

# A straggler's median step computes this many times the others': above what a busy machine
# makes of an even run, below a configured 4x straggler (the runs behind it:
# backends/PERFORMANCE.md). The median step, not totals: one step preempted by the operating
# system inflates a total.
STRAGGLER_RATIO = 2.0


@dataclass(frozen=True)
class RankStats:
    """One rank's time, in nanoseconds. ``overlap_pct``: the share of its communication hidden
    behind its own compute (100: communication cost nothing; 0: all of it was waited for)."""

    rank: int
    role: str  # "replica" (sync), "server" or "worker" (parameter server)
    span_ns: int  # first event's start to last event's end
    compute_ns: int
    comm_ns: int
    overlapped_ns: int
    exposed_ns: int  # communication with no compute under it
    wait_ns: int
    slowdown_ns: int  # a straggler's sleeps (inside its compute)
    # the median step's (clock's) compute: a preempted step does not move it
    step_compute_ns: float = 0.0

    @property
    def overlap_pct(self) -> float:
        return 100.0 * self.overlapped_ns / self.comm_ns if self.comm_ns else 0.0

    def row(self) -> dict[str, object]:
        """A table row in milliseconds."""
        ms = 1e-6
        return {"rank": self.rank, "role": self.role, "compute_ms": self.compute_ns * ms,
                "comm_ms": self.comm_ns * ms, "exposed_comm_ms": self.exposed_ns * ms,
                "overlap_pct": self.overlap_pct, "wait_ms": self.wait_ns * ms,
                "slowdown_ms": self.slowdown_ns * ms, "step_compute_ms": self.step_compute_ns * ms,
                "span_ms": self.span_ns * ms}


def _role(kinds: set[str]) -> str:
    if kinds & {"reply", "apply", "stop", "drop"}:
        return "server"
    return "worker" if kinds & {"pull", "push"} else "replica"


def _step_compute(evs: list[Event]) -> float:
    """The median over steps (sync) or clocks (async) of the compute time inside each."""
    steps: dict[int, list[Interval]] = {}
    for e in evs:
        key = e.extra.get("step", e.extra.get("clock"))
        if e.kind in COMPUTE_KINDS and key is not None:
            steps.setdefault(key, []).append((e.t_start_ns, e.t_end_ns))
    return float(statistics.median(measure(v) for v in steps.values())) if steps else 0.0


def rank_stats(events: Iterable[Event]) -> list[RankStats]:
    """Per rank (in rank order): compute, communication, their overlap, waiting, slowdown."""
    by_rank: dict[int, list[Event]] = {}
    for e in events:
        by_rank.setdefault(e.rank, []).append(e)
    out = []
    for rank in sorted(by_rank):
        evs = by_rank[rank]
        spans = {k: [(e.t_start_ns, e.t_end_ns) for e in evs if e.kind in k]
                 for k in (COMPUTE_KINDS, COMM_KINDS, WAIT_KINDS)}
        compute, comm = union(spans[COMPUTE_KINDS]), union(spans[COMM_KINDS])
        out.append(
            RankStats(
                rank=rank,
                role=_role({e.kind for e in evs}),
                span_ns=max(e.t_end_ns for e in evs) - min(e.t_start_ns for e in evs),
                compute_ns=measure(compute),
                comm_ns=measure(comm),
                overlapped_ns=measure(intersect(comm, compute)),
                exposed_ns=measure(subtract(comm, compute)),
                wait_ns=measure(spans[WAIT_KINDS]),
                slowdown_ns=measure(
                    (e.t_start_ns, e.t_end_ns) for e in evs if e.kind == "slowdown"
                ),
                step_compute_ns=_step_compute(evs),
            )
        )
    return out


def totals(stats: Sequence[RankStats]) -> dict[str, float]:
    """The whole run in milliseconds: communication, exposed communication and waiting summed over
    ranks (``*_ms``) and per rank, the mean over the ``ranks`` (``*_mean_ms``: what compares with
    ``wall_ms``); ``overlap_pct``: the share of all ranks' communication hidden behind compute."""
    n = len(stats)
    comm = sum(s.comm_ns for s in stats)
    overlapped = sum(s.overlapped_ns for s in stats)
    out = {"wall_ms": max((s.span_ns for s in stats), default=0) * 1e-6, "ranks": n,
           "compute_ms": sum(s.compute_ns for s in stats) * 1e-6, "comm_ms": comm * 1e-6,
           "exposed_comm_ms": sum(s.exposed_ns for s in stats) * 1e-6,
           "wait_ms": sum(s.wait_ns for s in stats) * 1e-6,
           "overlap_pct": 100.0 * overlapped / comm if comm else 0.0}
    for key in ("compute_ms", "comm_ms", "exposed_comm_ms", "wait_ms"):
        out[key.replace("_ms", "_mean_ms")] = out[key] / n if n else 0.0
    return out


def configured_stragglers(row: dict) -> tuple[int, ...] | None:
    """The ranks a run was told to slow down, from its result row's ``straggler`` ("none", "1:4",
    "0:2,3:4"); None when the row does not say (a trace file without its row)."""
    label = row.get("straggler")
    if not isinstance(label, str):
        return None
    if label == "none":
        return ()
    try:
        return tuple(int(part.split(":")[0]) for part in label.split(","))
    except ValueError:
        return None


@dataclass(frozen=True)
class Straggler:
    """The slowest computing rank, and whether it is slow enough to be called a straggler."""

    rank: int | None  # None: no rank computes STRAGGLER_RATIO times the others' median
    slowest: int | None  # the rank with the most compute (None: fewer than two computing ranks)
    ratio: float  # its compute over the median of the others'
    sentence: str
    # of a named rank: True when the run was told to slow it, False when not (the machine slowed
    # it), None when nobody said what was configured (or no rank is named)
    configured: bool | None = None


def _machine(ranks: int, cores: int | None) -> str:
    if cores is None:
        return "ranks sharing the machine's cores, with each other or with other work"
    if ranks > cores:
        return (f"{ranks} ranks sharing {cores} CPU core{'s' if cores != 1 else ''}: the operating "
                f"system gave this one less time")
    return f"the operating system or other work on the machine's {cores} CPU cores slowed it"


def find_straggler(stats: Sequence[RankStats], threshold: float = STRAGGLER_RATIO,
                   configured: Sequence[int] | None = None, cores: int | None = None) -> Straggler:
    """Name the rank whose compute most exceeds the others' (the parameter server is not a
    candidate).

    Compared per step (the median step's compute) when every rank's spans say their step, so one
    step preempted by the operating system does not make a straggler; the totals otherwise. A rank
    slowed on purpose is named by its own ``slowdown`` spans (the trainer recorded every sleep),
    whatever the machine did to the others: comparing it with busy neighbours can hide it.
    ``configured``: the ranks the run was told to slow down (``()``: none; None: not known). A rank
    slow enough but not configured is the machine's doing, and the sentence says so (with ``cores``,
    the CPU cores the ranks ran on, when known) instead of calling it the straggler.
    """
    cands = [s for s in stats if s.role != "server" and s.compute_ns > 0]
    if len(cands) < 2:
        return Straggler(None, None, 1.0, "no straggler: fewer than two ranks compute")
    slowed = [s for s in cands if s.slowdown_ns > 0]
    if slowed:
        return _slowed_on_purpose(max(slowed, key=lambda s: s.slowdown_ns), cands, configured)
    per_step = all(s.step_compute_ns > 0 for s in cands)
    of = (lambda s: s.step_compute_ns) if per_step else (lambda s: float(s.compute_ns))
    slow = max(cands, key=of)
    others = [s for s in cands if s is not slow]
    median = statistics.median(of(s) for s in others)
    ratio = of(slow) / median if median else float("inf")
    wait = statistics.mean(s.wait_ns for s in others) * 1e-6
    words = (f"{ratio:.1f}x the median compute{' per step' if per_step else ''} of the others "
             f"({of(slow) * 1e-6:.2f} ms vs {median * 1e-6:.2f} ms); the others wait {wait:.1f} ms "
             f"in all on average, it waits {slow.wait_ns * 1e-6:.1f} ms")
    if ratio < threshold:
        return Straggler(None, slow.rank, ratio,
                         f"no straggler (none computes {threshold:g}x the others): the slowest, "
                         f"rank {slow.rank}, takes {words}")
    if configured is None or slow.rank in configured:
        return Straggler(slow.rank, slow.rank, ratio, f"rank {slow.rank} is the straggler: {words}",
                         None if configured is None else True)
    told = ("no straggler was configured" if not configured else
            f"the configured straggler{'s are ranks' if len(configured) > 1 else ' is rank'} "
            f"{', '.join(map(str, configured))}")
    return Straggler(slow.rank, slow.rank, ratio,
                     f"rank {slow.rank} is the slowest, {words}. But {told}: this is the machine's "
                     f"doing ({_machine(len(stats), cores)}), not a configured straggler", False)


def _slowed_on_purpose(slow: RankStats, cands: Sequence[RankStats],
                       configured: Sequence[int] | None) -> Straggler:
    """A rank that slept on purpose (a configured straggler): named from its own spans."""
    median = statistics.median(s.compute_ns for s in cands if s is not slow)
    ratio = slow.compute_ns / median if median else float("inf")
    own = slow.compute_ns / max(1, slow.compute_ns - slow.slowdown_ns)
    return Straggler(slow.rank, slow.rank, ratio,
                     f"rank {slow.rank} is the straggler: slowed on purpose, it slept "
                     f"{slow.slowdown_ns * 1e-6:.1f} ms, {own:.1f}x its own compute, and computed "
                     f"{ratio:.1f}x the median of the others in all",
                     None if configured is None else slow.rank in configured)
