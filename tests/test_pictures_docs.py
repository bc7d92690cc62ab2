"""The pictures in the docstrings are renderings of the code that runs, character for character.

Schedule pictures are drawn through the simulator from the very schedules the executor runs.
Timing pictures cannot come from a real run (its times are noise), so they are drawn from
event lists built here, deterministically, by the code's own rules on integer time units:
``assign_buckets`` and the Reducer's launch rule for buckets; the server's ``Aggregator``
and its pull rule (``Server.decide``) for backup workers; the SSP ``Gate`` for staleness.

    python tests/test_pictures_docs.py      # print every picture as the code draws it today
"""

from __future__ import annotations

import heapq
import textwrap

import numpy as np
import pytest

from dplab.reference.algorithms import (
    direct,
    double_tree,
    naive,
    pipelined,
    rabenseifner,
    recursive_doubling,
    ring,
    tree,
)
from dplab.reference.pictures import render_arrows, render_rounds, render_timeline, render_tree
from dplab.reference.ps import trainer as ps_trainer
from dplab.reference.ps.aggregate import Aggregator
from dplab.reference.ps.gate import Gate
from dplab.reference.trace import Event
from dplab.reference.train import buckets as buckets_mod
from dplab.reference.train.buckets import assign_buckets

STOP = -1


def bucket_events(layer_units: int = 11, comm_units_per_param: int = 9) -> list[Event]:
    """One backward pass of 4 one-parameter layers and the Reducer's buckets, in time units.

    Backward makes layer 3's gradient first. A bucket is launched once its LAST parameter's
    backward has ENDED and every earlier bucket was launched (``mark_param_as_ready``); the
    comm thread reduces buckets one after another. Main waits at the end for the last one."""
    slices = [slice(i * 64, (i + 1) * 64) for i in range(4)]  # 64 float64 = 512 B per layer
    buckets = assign_buckets(slices, 8, bucket_cap_mb=1000 / 2**20)  # closes at >= 1000 B: 2 layers
    events, ready, t = [], {}, 0
    for layer in reversed(range(4)):
        events.append(Event(0, "backward", t, t + layer_units, extra={"label": f"layer {layer}"}))
        t += layer_units
        ready[layer] = t
    comm_free = 0
    for b, params in enumerate(buckets):
        start = max(comm_free, max(ready[i] for i in params))
        comm_free = start + comm_units_per_param * len(params)
        label = f"bucket {b} = {','.join(map(str, params))}"
        events.append(Event(0, "bucket", start, comm_free, thread="comm", extra={"label": label}))
    if comm_free > t:
        events.append(Event(0, "wait", t, comm_free, extra={"label": "wait"}))
    return events


def ps_events(units: dict[int, int], clocks: int, *, staleness: int | None = None,
              aggregate: bool = False, backup: int = 0) -> list[Event]:
    """Workers pulling, computing (``units[w]`` per clock) and pushing to the server, in time units.

    The server's rules, as ``Server.take_push``/``decide`` apply them: with aggregation a
    push is dropped if its clock was already applied, else held by the real ``Aggregator``
    until W - b have come; a pull for clock c is answered once version >= c with the CURRENT
    version as its clock. Without aggregation the real SSP ``Gate`` decides. Pushes at the
    same instant are taken in worker order, so the events are a pure function of the input."""
    workers = sorted(units)
    pool, gate, version = Aggregator(len(workers), backup), Gate(len(workers), staleness), 0
    last_clock = clocks - 1
    events, running, waiting = [], [], [(w, 0) for w in workers]  # running: (t_end, w, clock, t0)

    def decide(clock: int) -> int | None:
        if not aggregate:
            return (clock if gate.opens(clock) else None) if clock < clocks else STOP
        if version < clock:
            return None
        return version if version <= last_clock else STOP

    def release(now: int) -> None:
        for w, c in list(waiting):
            given = decide(c)
            if given is not None:
                waiting.remove((w, c))
                if given != STOP:
                    heapq.heappush(running, (now + units[w], w, given, now))

    release(0)
    while running:
        t, w, c, t0 = heapq.heappop(running)
        events.append(Event(w, "compute", t0, t, extra={"label": f"c{c}"}))
        gate.finish(w, c)
        if not aggregate:
            version += 1
            events.append(Event(0, "apply", t, t))
        elif pool.late(c, version):
            pool.drop(w, c)
            events.append(Event(0, "drop", t, t))
        elif pool.hold(w, c, np.zeros(1)) is not None:
            version += 1
            events.append(Event(0, "apply", t, t))
        if c + 1 < clocks:
            waiting.append((w, c + 1))
        release(t)
    return events


def _worker_lane(e: Event) -> str:
    return "server" if e.rank == 0 else f"worker {e.rank}"


PICTURES = {  # (module whose docstring holds it, how the code draws it today)
    "ring": (ring, lambda: render_rounds(ring.reduce_scatter(3))),
    "naive": (naive, lambda: render_rounds(naive.allreduce(3))),
    "direct": (direct, lambda: render_rounds(direct.allreduce(3))),
    "tree rounds": (tree, lambda: render_arrows(tree.reduce(6))),
    "tree paths": (tree, lambda: render_tree(tree.reduce(6))),
    "recursive doubling": (
        recursive_doubling,
        lambda: render_rounds(recursive_doubling.allreduce(6)),
    ),
    "rabenseifner": (rabenseifner, lambda: render_rounds(rabenseifner.allreduce(4))),
    "rabenseifner fold": (rabenseifner, lambda: render_rounds(rabenseifner.reduce_scatter(3))),
    "pipelined tree": (pipelined, lambda: render_tree(pipelined.pipelined_tree(8, 1))),
    "pipelined rounds": (pipelined, lambda: render_arrows(pipelined.pipelined_tree(4, 2))),
    "pipelined ring": (pipelined, lambda: render_arrows(pipelined.pipelined_ring(3, 2))),
    "double tree p=8": (
        double_tree,
        lambda: "\n\n".join(render_tree(double_tree.one_tree(8, w)) for w in (0, 1)),
    ),
    "double tree p=7": (
        double_tree,
        lambda: "\n\n".join(render_tree(double_tree.one_tree(7, w)) for w in (0, 1)),
    ),
    "buckets": (
        buckets_mod,
        lambda: render_timeline(
            bucket_events(), 1, lane=lambda e: e.thread, lanes=["main", "comm"]
        ),
    ),
    "backup workers": (
        ps_trainer,
        lambda: render_timeline(
            ps_events({1: 13, 2: 4, 3: 4}, clocks=8, aggregate=True, backup=1),
            1,
            lane=_worker_lane,
            lanes=["worker 1", "worker 2", "worker 3", "server"],
            marks={"apply": "^", "drop": "x"},
        ),
    ),
    "ssp": (
        ps_trainer,
        lambda: render_timeline(
            [e for e in ps_events({1: 4, 2: 12}, clocks=4, staleness=1) if e.kind == "compute"],
            1,
            lane=lambda e: ("fast", "slow")[e.rank - 1] + " worker",
            tick_every=4,
        ),
    ),
}


@pytest.mark.parametrize("name", list(PICTURES))
def test_pictures_docstring_equals_rendering(name: str) -> None:
    module, draw = PICTURES[name]
    picture = textwrap.indent(draw(), "    ")
    assert picture in module.__doc__, (
        f"the {name} picture in {module.__name__}'s docstring differs from what the code draws; "
        f"paste this (python tests/test_pictures_docs.py):\n{picture}")


def test_pictures_ring_holds_what_the_issue_says() -> None:
    """Issue 10's two corrections, read off the rendering: b02 after round 0, a12 to rank 0."""
    lines = render_rounds(ring.reduce_scatter(3)).splitlines()
    assert "  r0 [a0  b02 c0]   --b02--> r1" in lines
    assert "  r2 [a12 b2  c2]   --a12--> r0" in lines


def test_pictures_buckets_start_after_their_last_layer() -> None:
    events = bucket_events()
    end = {e.extra["label"]: e.t_end_ns for e in events if e.kind == "backward"}
    starts = {e.extra["label"]: e.t_start_ns for e in events if e.kind == "bucket"}
    assert starts == {"bucket 0 = 3,2": end["layer 2"], "bucket 1 = 1,0": end["layer 0"]}


def test_pictures_backup_drops_the_straggler() -> None:
    events = ps_events({1: 13, 2: 4, 3: 4}, clocks=8, aggregate=True, backup=1)
    computed = [(e.rank, e.extra["label"]) for e in events if e.kind == "compute" and e.rank == 1]
    assert computed == [(1, "c0"), (1, "c3"), (1, "c6")]  # it skips to the clock in progress
    assert (
        sum(e.kind == "apply" for e in events) == 8 and sum(e.kind == "drop" for e in events) == 3
    )
    assert max(e.t_end_ns for e in events if e.kind == "apply") == 32  # 8 clocks of the fast pair


def test_pictures_ssp_gate_holds_the_fast_worker() -> None:
    """s = 1: the fast worker's clock 2 waits for the slow one's clock 0 (t=12), clock 3 for 1
    (t=24)."""
    events = ps_events({1: 4, 2: 12}, clocks=4, staleness=1)
    fast = [e.t_start_ns for e in events if e.kind == "compute" and e.rank == 1]
    assert fast == [0, 4, 12, 24]


if __name__ == "__main__":
    for name, (module, draw) in PICTURES.items():
        print(f"--- {name} ({module.__name__})\n{textwrap.indent(draw(), '    ')}\n")
