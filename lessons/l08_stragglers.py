"""Lesson 8: stragglers, and backup workers that stop waiting for them.

    dplab lesson 8

Synchronous training moves at the pace of its slowest rank. Two steps: slow one rank down and
read from the trace who waits for whom; then let a parameter server drop the last gradient of
each step (backup workers, Chen et al. 2016) and see what that buys and what it costs.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from dplab.lessons.exercises import STUBS, check_file
from dplab.lessons.exercises.backup import HINTS as BACKUP_HINTS
from dplab.lessons.l05_scaling import _bars
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLPConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

TRAIN = TrainConfig(model=MLPConfig(hidden=(64, 64)), global_batch=128, num_samples=512, steps=20)
SLOW = 0.05                                    # seconds rank 1 sleeps before each batch: a slower device


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


def simulated_clock(compute, needed):
    """Simulated time of each step: it ends when the ``needed``-th
    gradient arrives (``compute[step, worker]``: each worker's time)."""
    return np.sort(compute, axis=1)[:, needed - 1]


def backup_on_the_clock(lab):
    n, steps = 8, 10_000                    # N gradients make an update
    rng = np.random.default_rng(0)
    # every worker 1 time unit, plus a tail: 5% of steps 4x slower
    compute = 1 + 0.1 * rng.exponential(size=(steps, n + 2))
    compute *= np.where(rng.random(compute.shape) < 0.05, 4, 1)
    rows = {}
    for b in (0, 1, 2):                      # backup workers
        step = simulated_clock(compute[:, :n + b], needed=n)
        rows[b] = (step.mean(), np.percentile(step, 99), n / (n + b))
    # with no backup, a step is slow when any of the N workers is
    slow_share = float((compute[:, :n] > 2).any(axis=1).mean())
    table = "\n".join(f"| {b} | {n + b} | {m:.2f} | {p99:.2f} | {used:.0%} |"
                       for b, (m, p99, used) in rows.items())
    return {"n": n, "steps": steps, "table": table,
            "mean": {b: r[0] for b, r in rows.items()},
            "p99": {b: r[1] for b, r in rows.items()},
            "speedup_1": rows[0][0] / rows[1][0],
            "speedup_2": rows[0][0] / rows[2][0],
            "slow_pct": 100 * slow_share,
            "exact_pct": 100 * (1 - 0.95 ** n)}


def backup_in_the_engine(lab):
    cfg = AsyncConfig(staleness=0, aggregate=True, backup_workers=1,
                      delays=(SLOW, 0, 0))
    # rank 0 serves, 1..3 compute: W = 3 workers, the first 2 make an update
    server = lab.world(4).run(train_async, TRAIN, cfg)[0]
    dropped = Counter(worker for worker, _ in server.dropped)
    applied = Counter(entry.worker for entry in server.log)
    # every worker named, one with none applied too
    applied = {w: applied[w] for w in (1, 2, 3)}
    again = replay(TRAIN, cfg, server.log, 3)
    single = train_single(TRAIN).params
    lost = {w: dropped[w] / max(dropped[w] + applied[w], 1) for w in (1, 2, 3)}
    return {"dropped": dict(sorted(dropped.items())),
            "steps": TRAIN.steps, "slow_ms": SLOW * 1e3,
            "replay_exact": bool(np.array_equal(again, server.params)),
            "diff": float(np.abs(server.params - single).max()),
            "lost": lost,
            "lost_1": "all" if lost[1] == 1 else f"{lost[1]:.0%}",
            "applied": applied,
            "applied_1": applied[1],
            "shard_in": share_in_words(applied[1], TRAIN.steps),
            "dropped_1": dropped[1],
            "pushed_1": applied[1] + dropped[1],
            "applied_text": in_words(applied),
            "dropped_text": in_words(dropped)}


def share_in_words(n, of):
    """How many batches a shard made it into, in words: "none of the
    20", "only 3 of the 20", "all 20"."""
    if n == 0:
        return f"none of the {of}"
    return f"all {of}" if n == of else f"only {n} of the {of}"


def _example(arrivals, n):
    """The dropped worker and the step's end (kept out of the shown code: it is the exercise)."""
    order = sorted(range(len(arrivals)), key=lambda w: (arrivals[w], w))
    return order[-1], arrivals[order[n - 1]]


def the_backup_step(lab):
    # one step: 4 workers, 3 gradients make the update
    arrivals = [0.4, 0.1, 0.3, 0.2]
    dropped, t_end = _example(arrivals, 3)
    # what `dplab lesson check 8` says of the stub as shipped
    stub = check_file("backup_step", STUBS / "backup_step.py")
    return {"arrivals": arrivals, "dropped": str(dropped), "t_end": t_end,
            "stub_passed": stub.passed, "stub_says": stub.message}


STEPS = (
    Step(
        title="A straggler sets everyone's pace",
        text=("Rank {straggler} starts each of its {steps} batches {slow_ms:.0f} ms late, as a slower "
              "device would. In the trace the ranks spent these milliseconds waiting: {wait}. The "
              "straggler waits least - rank {least_waiting} - and every other rank waits for *it*, "
              "every step: a synchronous step ends when the last gradient arrives. (A {slow_ms:.0f} ms "
              "sleep dwarfs the noise of these shared cores, so the measurement carries this claim; a "
              "handicap as small as the compute would not.) The parameters are the same bits as without "
              "the straggler ({same_bits}): a straggler changes when things happen, never what is "
              "computed."),
        run=one_slow_rank,
        checks=(Check("each fast rank waits more than twice as long as the straggler",
                      lambda f: min(w for r, w in enumerate(f["wait"]) if r != f["straggler"])
                      > 2 * f["wait"][f["straggler"]]),
                Check("the parameters are the same bits as without a straggler", lambda f: f["same_bits"])),
        figure=_timeline,
        predict=Predict("Rank 1 starts every batch late; ranks 0, 2 and 3 are on time. Which rank spends "
                        "the least time waiting?", "least_waiting", choices=("0", "1", "2", "3"),
                        misconceptions=(("0", "an all-reduce has no master: rank 0 waits for the late rank "
                                              "like everyone else"),)),
        hint="Waiting happens where a rank needs a message that is not there yet.",
        try_this="dplab compare --modes sync,async --world-sizes 4 --straggler 1:4",
        explore=Explore("runs"),
        teaches=("stragglers",),
    ),
    Step(
        title="Backup workers: N + b workers, the first N gradients",
        text=("Chen et al. (2016) run **N + b** workers and build each update from the **first N** "
              "gradients to arrive; the b slowest are dropped. Every worker draws its own random "
              "minibatch, so the update is always N minibatches of fresh samples: no data is lost by "
              "design, only the compute of the b dropped ones.\n\n"
              "On a simulated clock (no timing noise: each worker takes 1 unit plus a small random tail, "
              "and in 5% of steps 4 units), N = {n}, over {steps:,} steps:\n\n"
              "| b | workers | mean step | 99th percentile | compute used |\n"
              "|---|---|---|---|---|\n{table}\n\n"
              "Waiting for all {n}, {slow_pct:.1f}% of the simulated steps have a slow worker (the "
              "chance is 1 - 0.95^{n} = {exact_pct:.1f}%). One backup worker makes "
              "the mean step {speedup_1:.2f}x faster, two {speedup_2:.2f}x: the "
              "step no longer waits for the rare slow worker, at the price of the dropped workers' "
              "compute."),
        run=backup_on_the_clock,
        checks=(Check("one backup worker shortens the mean step", lambda f: f["speedup_1"] > 1),
                Check("two shorten it more", lambda f: f["speedup_2"] > f["speedup_1"])),
        inputs={"n": 8},
        predict=Predict("Each of N = {n} workers is slow in 5% of steps, independently. In what percentage "
                        "of steps is at least one of them slow?", "slow_pct", rel_tol=0.1, unit="%",
                        label="the share in {steps:,} simulated steps; exactly, 1 - 0.95^{n} = "
                              "{exact_pct:.1f}%",
                        misconceptions=((5, "5% is one worker's chance; a step waits if ANY of the 8 "
                                            "is slow: 1 - 0.95^8"),
                                        (40, "8 × 5% counts the steps where two are slow twice: "
                                             "1 - 0.95^8"))),
        hint="With 8 workers, the chance that none is slow in a step is 0.95^8.",
        try_this="Change the 5% in backup_on_the_clock to 1% and to 20%: when do backups pay?",
        show=(simulated_clock,),
        picture=lambda f: _bars([(f"b={b} mean", m) for b, m in f["mean"].items()]
                                + [(f"b={b} p99", m) for b, m in f["p99"].items()], " units",
                                title="simulated step time, N = 8"),
        teaches=("stragglers",),
    ),
    Step(
        title="Backup workers in the engine: whose data is dropped",
        text=("The engine's parameter server does the same with W = 3 workers and b = 1: each update "
              "takes the first 2 gradients of a clock. But here every worker owns a fixed **shard** of "
              "the clock's batch, so the dropped gradient takes its shard's samples with it. Worker 1 "
              "starts each clock {slow_ms:.0f} ms late. Gradients applied in the {steps} updates: "
              "{applied_text}; dropped: {dropped_text}. Worker 1 pushed only **{pushed_1} of a possible "
              "{steps}** gradients ({applied_1} applied): each update needs only the first 2, so the fast "
              "workers never wait for it. They ran through the clocks while it sat out its late starts; a "
              "gradient of its that came after its clock had its 2 was dropped, and the {steps} updates "
              "were done before it could push more. So its shard made it into {shard_in} batches: a "
              "bias toward the fast workers' data "
              "that Chen et al.'s random minibatches avoid. The run is still exactly what its log says "
              "(replay: {replay_exact}), but not one device's SGD: the parameters end {diff:.2g} away."),
        run=backup_in_the_engine,
        checks=(Check("the late worker loses a larger share of its gradients than either fast worker",
                      lambda f: f["lost"][1] > max(f["lost"][2], f["lost"][3])),
                Check("the late worker pushed fewer gradients than there were updates",
                      lambda f: f["pushed_1"] < f["steps"]),
                Check("every update went ahead with 2 of the 3 gradients",
                      lambda f: sum(f["applied"].values()) == 2 * f["steps"]),
                Check("the run replays exactly from its log", lambda f: f["replay_exact"]),
                Check("but it is not single-device SGD any more (> 1e-6 apart)", lambda f: f["diff"] > 1e-6)),
        hint="mode backup is synchronous SGD with b gradients dropped per step (dplab train --mode backup).",
        try_this="dplab train --mode backup --backup-workers 1 --world-size 4 --straggler 1:8",
        teaches=("stragglers",),
    ),
    Step(
        title="Exercise: the first n of N + b",
        text=("Now write the server's side of a step. `dplab lesson init DIR` copies the exercise stubs "
              "into DIR; fill in `backup_step(arrivals, grads, n)` in DIR/backup_step.py: the mean of the "
              "first n gradients to arrive (added in worker order, so the bits never depend on the order "
              "they came in) and the time the step ends. `dplab lesson check 8 DIR` tries it on 200 cases "
              "(ties, no backups, a single gradient), names the mistake if it knows it, and then runs your "
              "function on step 2's simulated clock.\n\n"
              "For example, gradients arriving at {arrivals} with n = 3: worker {dropped} is the backup "
              "that is dropped, and the step ends at {t_end}. The stub waits for everyone; checking it as "
              "shipped says:\n\n> {stub_says}"),
        run=the_backup_step,
        checks=(Check("the stub fails its check, naming the mistake",
                      lambda f: not f["stub_passed"] and "plain synchronous SGD" in f["stub_says"]),),
        predict=Predict("Gradients arrive at [0.4, 0.1, 0.3, 0.2] (workers 0-3) and n = 3. Which worker's "
                        "gradient is dropped?", "dropped", choices=("0", "1", "2", "3"),
                        misconceptions=(("3", "worker 3 is the last by NUMBER; the backup dropped is the "
                                              "last to ARRIVE"),)),
        hint=BACKUP_HINTS[0],
        hints=BACKUP_HINTS[1:],
        try_this="dplab lesson init ex && dplab lesson check 8 ex   # edit ex/backup_step.py until it passes",
        exercise="backup_step",
        show=("dplab.lessons.exercises.stubs.backup_step.backup_step",),
        teaches=("stragglers",),
    ),
)

LESSON = Lesson(8, "stragglers", "Stragglers and backup workers",
                "Why one slow rank slows every rank, what N + b backup workers buy, and whose data they "
                "drop.",
                STEPS)
