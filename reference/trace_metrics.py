"""Where a step's time went, from its trace: compute, exposed communication, waiting, the rest.

Interval arithmetic on ``[start, end)`` spans in nanoseconds. Spans nest (a bucket holds its
all-reduce, which holds its sends) and overlap across threads (the comm thread reduces a bucket
while the main thread's backward runs), so a total is always the measure of a union, and a split
of a step into parts takes each part minus the ones before it, so that nothing is counted twice:

    step:      [------------------------------------------------------------------]
    compute:   [ forward ][ backward ..........]              [opt]
    comm:                     [ bucket 0 ][ bucket 1 ...........]
    wait:                                  [ wait ...............]
    split:     compute = |compute|, exposed_comm = |comm - compute|,
               waiting = |wait - comm - compute|, other = the rest (Python between phases)

    from dplab.reference.trace_metrics import step_split
    split = step_split(events_of_one_rank, first_step=1)   # per-step means in ms; they add up

``dplab.viz.timeline_metrics`` (the app's Runs page) and ``dplab scaling`` both count with these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dplab.reference.errors import ConfigError
from dplab.reference.trace import Event

__all__ = ["Interval", "union", "measure", "intersect", "subtract", "COMPUTE_KINDS", "COMM_KINDS",
           "WAIT_KINDS", "StepSplit", "step_split"]

Interval = tuple[int, int]  # [start, end) in ns

COMPUTE_KINDS = frozenset({"forward", "backward", "optimizer", "compute", "apply"})
# a collective (its own span and every send/receive inside it) or a parameter-server transfer
COMM_KINDS = frozenset({"bucket", "allreduce", "broadcast", "reduce_scatter", "allgather", "reduce",
                        "send", "copy", "pull", "push", "reply", "stop"})
# sync: the main thread blocked on the last bucket; async: at the gate
WAIT_KINDS = frozenset({"wait"})


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the same time; empty ones vanish.

    Args:
        intervals: (start, end) pairs.

    Returns:
        The union, as sorted disjoint pairs.
    """
    out: list[list[int]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(intervals: Iterable[Interval]) -> int:
    """Total time covered (overlaps counted once).

    Args:
        intervals: (start, end) pairs.

    Returns:
        The length of their union.
    """
    return sum(b - a for a, b in union(intervals))


def intersect(xs: Iterable[Interval], ys: Iterable[Interval]) -> list[Interval]:
    """The time covered by both.

    Args:
        xs: (start, end) pairs.
        ys: (start, end) pairs.

    Returns:
        The intersection, as sorted disjoint pairs.
    """
    xs, ys = union(xs), union(ys)
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs: Iterable[Interval], ys: Iterable[Interval]) -> list[Interval]:
    """The time covered by ``xs`` and not by ``ys``.

    Args:
        xs: (start, end) pairs.
        ys: (start, end) pairs.

    Returns:
        The difference, as sorted disjoint pairs.
    """
    out: list[Interval] = []
    ys = union(ys)
    for a, b in union(xs):
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class StepSplit:
    """One rank's mean step in milliseconds, split into four disjoint parts that add up to
    ``step_ms``.

    Args:
        steps: steps in the timed window.
        step_ms: the mean step.
        compute_ms: forward, backward and optimizer.
        exposed_comm_ms: communication with no compute under it.
        waiting_ms: blocked while neither computing nor communicating.
        other_ms: the rest.
    """

    steps: int  # steps in the timed window
    step_ms: float
    compute_ms: float
    exposed_comm_ms: float  # communication with no compute under it
    waiting_ms: float  # blocked (a wait span) while neither computing nor communicating
    other_ms: float  # none of those: Python between phases, batching, the loss


def step_split(events: Iterable[Event], first_step: int = 0) -> StepSplit:
    """Split one rank's synchronous-training steps ``first_step``.. (the earlier ones are warm-up).

    The window runs from the first forward of ``first_step`` to the end of the last step's last
    event; every span is clipped to it. The trainer tags forward, backward, wait and optimizer
    spans with their step (``extra["step"]``); communication spans are taken as they fall.

    Args:
        events: one rank's trace events.
        first_step: the first step counted.

    Returns:
        Per step in milliseconds: the step, compute, exposed communication, waiting and the rest.

    Raises:
        ConfigError: no forward span from ``first_step`` on.
    """
    evs = list(events)
    starts = [
        e.t_start_ns for e in evs if e.kind == "forward" and e.extra.get("step", -1) >= first_step
    ]
    steps = {e.extra["step"] for e in evs if "step" in e.extra and e.extra["step"] >= first_step}
    if not starts:
        raise ConfigError(f"no forward span of step {first_step} or later in the trace: train more "
                          "steps than the warm-up, with tracing on")
    a = min(starts)
    b = max(e.t_end_ns for e in evs if e.extra.get("step", -1) >= first_step)
    window = [(a, b)]

    def spans(kinds: frozenset[str]) -> list[Interval]:
        return intersect([(e.t_start_ns, e.t_end_ns) for e in evs if e.kind in kinds], window)

    compute = union(spans(COMPUTE_KINDS))
    exposed = subtract(spans(COMM_KINDS), compute)
    waiting = subtract(subtract(spans(WAIT_KINDS), compute), spans(COMM_KINDS))
    n, ms = len(steps), 1e-6
    total, c, x, w = b - a, measure(compute), measure(exposed), measure(waiting)
    return StepSplit(
        n, total * ms / n, c * ms / n, x * ms / n, w * ms / n, (total - c - x - w) * ms / n
    )
