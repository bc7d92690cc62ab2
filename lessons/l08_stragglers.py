"""Lesson 8: stragglers, and backup workers that stop waiting for them.

    dplab lesson 8

Synchronous training moves at the pace of its slowest rank. Two steps: slow one rank down and
read from the trace who waits for whom; then let a parameter server drop the last gradient of
each step (backup workers, Chen et al. 2016) and see what that buys and what it costs.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLPConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

TRAIN = TrainConfig(model=MLPConfig(hidden=(64, 64)), global_batch=128, num_samples=512, steps=20)
SLOW = 0.01                                    # seconds rank 1 sleeps before each batch: a slower device


def milliseconds(events, kind):
    """Per rank, the time its trace spent in events of ``kind``."""
    spent = defaultdict(float)
    for rank, rank_events in enumerate(events):
        for e in rank_events:
            if e.kind == kind:
                spent[rank] += (e.t_end_ns - e.t_start_ns) / 1e6
    return [spent[r] for r in range(len(events))]


def train_traced(comm, cfg, sync):
    comm.tracer.enabled = True
    result = train_sync(comm, cfg, sync)
    comm.tracer.enabled = False
    return result.params, comm.tracer.take()


def one_slow_rank(lab):
    world = lab.world(4)
    slow = SyncConfig(delays=(0, SLOW, 0, 0))
    plain = world.run(train_traced, TRAIN, SyncConfig())
    slowed = world.run(train_traced, TRAIN, slow)
    events = [rank_events for _, rank_events in slowed]
    wait = milliseconds(events, "wait")
    same = all(np.array_equal(a, b)
               for (a, _), (b, _) in zip(plain, slowed))
    return {"slow_ms": SLOW * 1e3, "steps": TRAIN.steps,
            "straggler": 1,
            "wait": [round(w) for w in wait],
            "least_waiting": str(min(range(4), key=lambda r: wait[r])),
            "events": events,
            "same_bits": same}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    events = [e for rank in facts["events"] for e in rank]
    return timeline_figure(events, title=f"rank 1 is {facts['slow_ms']:.0f} ms late each step")


def in_words(counts):
    words = [f"worker {w}: {n}" for w, n in sorted(counts.items())]
    return ", ".join(words) or "none"


def backup_workers(lab):
    cfg = AsyncConfig(staleness=0, aggregate=True, backup_workers=1,
                      delays=(SLOW, 0, 0))
    # rank 0 serves, 1..3 compute
    server = lab.world(4).run(train_async, TRAIN, cfg)[0]
    dropped = Counter(worker for worker, _ in server.dropped)
    applied = Counter(entry.worker for entry in server.log)
    again = replay(TRAIN, cfg, server.log, 3)
    single = train_single(TRAIN).params
    return {"dropped": dict(sorted(dropped.items())),
            "total": len(server.dropped),
            "steps": TRAIN.steps,
            "replay_exact": bool(np.array_equal(again, server.params)),
            "diff": float(np.abs(server.params - single).max()),
            "lost": {w: dropped[w] / max(dropped[w] + applied[w], 1)
                     for w in (1, 2, 3)},
            "applied": dict(applied),
            "applied_text": in_words(applied),
            "dropped_text": in_words(dropped)}


STEPS = (
    Step(
        title="A straggler sets everyone's pace",
        text=("Rank {straggler} starts each of its {steps} batches {slow_ms:.0f} ms late, as a slower "
              "device would. In the trace the ranks spent these milliseconds waiting: {wait}. The "
              "straggler waits least - rank {least_waiting} - and every other rank waits for *it*, "
              "every step: a synchronous step ends when the last gradient arrives. The parameters are "
              "the same bits as without the straggler (`{same_bits}`): a straggler changes when "
              "things happen, never what is computed."),
        run=one_slow_rank,
        checks=(Check("each fast rank waits more than twice as long as the straggler",
                      lambda f: min(w for r, w in enumerate(f["wait"]) if r != f["straggler"])
                      > 2 * f["wait"][f["straggler"]]),
                Check("the parameters are the same bits as without a straggler", lambda f: f["same_bits"])),
        figure=_timeline,
        predict=Predict("Rank 1 starts every batch late; ranks 0, 2 and 3 are on time. Which rank spends "
                        "the least time waiting?", "least_waiting", choices=("0", "1", "2", "3")),
        hint="Waiting happens where a rank needs a message that is not there yet.",
        try_this="dplab compare --modes sync,async --world-sizes 4 --straggler 1:4",
        explore=Explore("runs"),
        teaches=("stragglers",),
    ),
    Step(
        title="Backup workers: stop waiting for the last one",
        text=("Through a parameter server, each update takes the first gradients to arrive and drops "
              "the last one (one backup worker, Chen et al. 2016); a worker whose gradient was dropped "
              "skips to the step in progress. Gradients in the {steps} updates: {applied_text}; "
              "dropped: {dropped_text}. The fast workers do not wait for the late one, which computes "
              "only a few steps, and loses most of them. The run is still exactly what its log says "
              "(replay: `{replay_exact}`), but it is no longer one device's SGD: the parameters end "
              "{diff:.2g} away, because the late worker's shard of each batch is never seen (a bias "
              "toward the fast workers' data)."),
        run=backup_workers,
        checks=(Check("the late worker loses a larger share of its gradients than either fast worker",
                      lambda f: f["lost"][1] > max(f["lost"][2], f["lost"][3])),
                Check("every update went ahead without waiting for all three",
                      lambda f: sum(f["applied"].values()) == 2 * f["steps"]),
                Check("the run replays exactly from its log", lambda f: f["replay_exact"]),
                Check("but it is not single-device SGD any more (> 1e-6 apart)", lambda f: f["diff"] > 1e-6)),
        hint="mode backup is synchronous SGD with b gradients dropped per step (dplab train --mode backup).",
        try_this="dplab train --mode backup --backup-workers 1 --world-size 4 --straggler 1:8",
        teaches=("stragglers",),
    ),
)

LESSON = Lesson(8, "stragglers", "Stragglers and backup workers",
                "Why one slow rank slows every rank, and what dropping its gradient buys and costs.", STEPS)
