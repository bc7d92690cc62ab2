"""Lesson 7: synchronous vs asynchronous training, staleness and stale synchronous parallel (SSP).

    dplab lesson 7

Four steps: give both kinds of training the same wall time with one late worker and count what
each applied; bound how far ahead of the slowest a worker may run (SSP, in clocks); read the
delay histogram from the server's log (in updates) and replay the log to the same bits; then
write the SSP gate yourself (the exercise ``ssp_gate``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from dplab.backends.runs.run import RunSpec
from dplab.lessons.exercises import STUBS, check_file
from dplab.lessons.exercises.ssp import HINTS as SSP_HINTS
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLPConfig
from dplab.reference.ps.gate import gate_open
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async, worker_batch
from dplab.reference.train.single import TrainConfig, evaluate, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

TRAIN = TrainConfig(model=MLPConfig(hidden=(64, 64)), global_batch=128, num_samples=512, steps=20)
LATE = 0.05                                    # seconds the late worker sleeps before each batch
BUDGET = 0.4                                   # seconds of wall time each run gets in step 1
SSP_LATE = 0.01                                # steps 2 and 3: worker 1's lateness before each clock
WORKERS = 3                                    # world of 4: rank 0 serves, ranks 1..3 compute


def same_wall_time(lab):
    # 500 steps: an upper bound, the budget stops it
    world, cfg = lab.world(4), replace(TRAIN, steps=500)
    # rank 3 starts every batch LATE seconds late
    late = (0.0, 0.0, 0.0, LATE)
    # fresh ranks warm up (imports, schedules), untimed
    world.run(train_sync, replace(cfg, steps=1))
    sync_cfg = SyncConfig(delays=late, time_budget_s=BUDGET)
    ps_cfg = AsyncConfig(staleness=None, delays=late[1:],
                         time_budget_s=BUDGET)
    sync = world.run(train_sync, cfg, sync_cfg)[0]
    ps = world.run(train_async, cfg, ps_cfg)[0]
    steps = len(sync.losses)
    sync_samples = steps * cfg.global_batch
    ps_samples = sum(len(worker_batch(cfg, e.worker, WORKERS, e.clock))
                     for e in ps.log)
    late_share = sum(e.worker == 3 for e in ps.log) / len(ps.log)
    # one device, as many steps
    single = train_single(replace(cfg, steps=steps)).params
    again = replay(cfg, AsyncConfig(staleness=None), ps.log, WORKERS)
    return {"budget": BUDGET, "late_ms": LATE * 1e3,
            "sync_steps": steps, "sync_step_ms": BUDGET * 1e3 / steps,
            "sync_samples": sync_samples,
            "async_samples": ps_samples,
            "ratio": ps_samples / sync_samples,
            "sync_loss": evaluate(cfg, sync.params),
            "async_loss": evaluate(cfg, ps.params),
            "late_share": late_share,
            "more": "async" if ps_samples > sync_samples else "sync",
            "sync_vs_single": float(np.abs(sync.params - single).max()),
            "replay_exact": bool(np.array_equal(again, ps.params))}


def clocks_ahead(log):
    """How far ahead of the slowest worker any gradient's worker ran,
    in clocks (SSP's measure)."""
    return max(e.clock - e.slowest_done for e in log)


def ssp_runs(lab, bounds):
    """One parameter-server run per staleness bound, worker 1 starting
    each clock SSP_LATE seconds late."""
    world = lab.world(4)
    late = (SSP_LATE, 0.0, 0.0)
    return {s: world.run(train_async, TRAIN,
                         AsyncConfig(staleness=s, delays=late))[0]
            for s in bounds}


def staleness_bound(lab):
    runs = ssp_runs(lab, (0, 1, 2, None))
    ahead = {s: clocks_ahead(r.log) for s, r in runs.items()}
    table = "\n".join(f"| {'inf' if s is None else s} | {a} |"
                      for s, a in ahead.items())
    return {"late_ms": SSP_LATE * 1e3, "clocks": TRAIN.steps,
            "ahead": ahead,
            "ahead_2": ahead[2],
            "ahead_none": ahead[None],
            "table": table}


def delay_histogram(lab):
    runs = ssp_runs(lab, (0, 2, None))
    delays = {s: [e.delay for e in r.log] for s, r in runs.items()}
    # delay <= (W - 1)(2s + 1)
    bound = {s: (WORKERS - 1) * (2 * s + 1) for s in (0, 2)}

    def replays_exactly(s, run):
        again = replay(TRAIN, AsyncConfig(staleness=s), run.log, WORKERS)
        return np.array_equal(again, run.params)

    exact = all(replays_exactly(s, r) for s, r in runs.items())
    seen = Counter(delays[0])
    hist = ", ".join(f"{n} at delay {d}" for d, n in sorted(seen.items()))
    return {"hist_0": hist,
            "delays_0": sorted(seen),
            "logs": {s: r.log for s, r in runs.items()},
            "max_delay": {s: max(d) for s, d in delays.items()},
            "max_0": max(delays[0]),
            "max_2": max(delays[2]),
            "max_none": max(delays[None]),
            "bound_0": bound[0], "bound_2": bound[2],
            "workers": WORKERS,
            "replay_exact": exact,
            "updates": len(runs[0].log),
            "late_ms": SSP_LATE * 1e3}


def _histogram(facts):
    from dplab.viz.training import delay_figure
    from dplab.viz.training_runs import Cell
    cells = [Cell(RunSpec(world_size=4, mode="async", staleness=s, train=TRAIN),
                  {"mode": "async", "algorithm": f"ps s={'inf' if s is None else s}",
                   "straggler": f"worker 1 +{facts['late_ms']:g} ms"}, [], [], [], log=log)
             for s, log in facts["logs"].items()]
    return delay_figure(cells)


def the_gate(lab):
    # clocks finished by workers 1, 2, 3
    done = [3, 1, 2]
    opens = {clock: gate_open(done, clock, staleness=1)
             for clock in (1, 2, 3)}
    # what `dplab lesson check 7` says of the stub
    stub = check_file("ssp_gate", STUBS / "ssp_gate.py")
    held = min(c for c, ok in opens.items() if not ok)
    return {"done": done, "slowest": min(done),
            "opens": opens, "open_2": opens[2], "open_3": opens[3],
            "stub_passed": stub.passed,
            "stub_says": stub.message,
            "first_held": str(held)}


STEPS = (
    Step(
        title="Sync waits for the slowest; async does not",
        text=("Four ranks, {budget:g} s of wall time each way, and rank 3 starts every batch "
              "{late_ms:.0f} ms late. **Synchronous** training (all-reduce) ends a step only when the "
              "last gradient arrives: it managed {sync_steps} steps, {sync_samples:,} samples, and it is "
              "still one device's SGD (parameters {sync_vs_single:.1e} from it). **Asynchronous** training "
              "through a parameter server (rank 0 serves, ranks 1-3 pull, compute, push; nobody waits: "
              "staleness inf, `--staleness inf`) applied "
              "**{async_samples:,} samples, {ratio:.1f}x as many**, and reached a "
              "loss of {async_loss:.4f} against sync's {sync_loss:.4f}. (A sync step took "
              "{sync_step_ms:.0f} ms, {late_ms:.0f} of them the late rank's sleep: the race is decided "
              "by the handicap, not by the noise of these shared cores.)\n\n"
              "The price: the late worker's gradients are only {late_share:.0%} of those applied (its shard "
              "of each batch is seen rarely), and every gradient was computed on parameters that others "
              "had already moved. The run is not any one device's SGD, but it is exactly what its log "
              "says: replaying the log on one device gives the same bits ({replay_exact})."),
        run=same_wall_time,
        checks=(Check("in the same wall time async applies more than twice the samples",
                      lambda f: f["ratio"] > 2),
                Check("and reaches a lower loss than sync", lambda f: f["async_loss"] < f["sync_loss"]),
                Check("the late rank's sleep is most of a sync step",
                      lambda f: f["sync_step_ms"] < 2 * f["late_ms"]),
                Check("the late worker's share of the applied gradients is under a third",
                      lambda f: f["late_share"] < 1 / 3),
                Check("sync stays single-device SGD (< 1e-12)", lambda f: f["sync_vs_single"] < 1e-12),
                Check("the async run replays exactly from its log", lambda f: f["replay_exact"])),
        inputs={"late_ms": LATE * 1e3, "budget": BUDGET},
        predict=Predict("Rank 3 starts every batch {late_ms:.0f} ms late. In {budget:g} s, which applies "
                        "more samples: 'sync' or 'async'?", "more", choices=("sync", "async")),
        hint="A synchronous step needs every rank's gradient; a parameter server applies each as it comes.",
        try_this="dplab compare --modes sync,async --world-sizes 4 --straggler 3:8 --time-budget 1",
        explore=Explore("training", lambda f: {"world_size": 4, "steps": 20, "staleness": "0,2,inf"}),
        teaches=("sync-async",),
    ),
    Step(
        title="Bounded staleness: SSP counts clocks",
        text=("A worker's **clock** is how many pull-compute-push rounds it has finished. Unbounded, a fast "
              "worker races ahead of a slow one; **stale synchronous parallel** (SSP, Ho et al. 2013) lets "
              "it run at most S clocks ahead: the server holds a pull for clock c until the slowest worker "
              "has finished c - S clocks. S = 0 is lock-step, S = inf never waits "
              "(`--staleness inf`; `None` in the code).\n\n"
              "Worker 1 starts each of its {clocks} clocks {late_ms:.0f} ms late. From each run's log, the "
              "furthest any worker ran ahead of the slowest (clock - slowest's finished clocks):\n\n"
              "| staleness S | most clocks ahead |\n|---|---|\n{table}\n\n"
              "The fast workers run straight up to the bound and wait there; without one they finish "
              "{ahead_none} clocks ahead."),
        run=staleness_bound,
        checks=(Check("no worker ever ran more than S clocks ahead of the slowest",
                      lambda f: all(a <= s for s, a in f["ahead"].items() if s is not None)),
                Check("with S = 2 the fast workers reach the bound (they wait only there)",
                      lambda f: f["ahead_2"] == 2),
                Check("unbounded, they run further ahead than any bound shown",
                      lambda f: f["ahead_none"] > 2)),
        inputs={"late_ms": SSP_LATE * 1e3},
        predict=Predict("Worker 1 is {late_ms:.0f} ms late every clock; the staleness is 2. How many clocks "
                        "ahead of it does the fastest worker get, at most?", "ahead_2"),
        hint="The gate opens clock c once the slowest has finished c - S clocks: c - (c - S) = S.",
        try_this="dplab train --mode async --staleness 1 --world-size 4 --straggler 1:8",
        explore=Explore("runs", lambda f: {"p": 4, "mode": "async", "staleness": 2}),
        teaches=("staleness",),
    ),
    Step(
        title="The delay histogram, and a log that replays exactly",
        text=("Staleness counts clocks; what the optimizer feels is the **delay**, counted in updates: how "
              "many other gradients the server applied between the pull a gradient was computed on and its "
              "own update. With W = {workers} workers and staleness S it is at most (W - 1)(2S + 1): "
              "{bound_0} at S = 0, {bound_2} at S = 2. Measured, over {updates} updates per run: largest "
              "delay {max_0} at S = 0 (of its gradients, {hist_0}), {max_2} at S = 2 and "
              "{max_none} unbounded.\n\n"
              "No run is reproducible by running it again (the interleaving is timing), but each is "
              "reproducible from its log: every gradient is a pure function of (parameter version, worker, "
              "clock). Replaying each log on one device gives the server's final parameters, bit for bit "
              "({replay_exact})."),
        run=delay_histogram,
        checks=(Check("delays stay within (W - 1)(2S + 1) for S = 0 and S = 2",
                      lambda f: f["max_0"] <= f["bound_0"] and f["max_2"] <= f["bound_2"]),
                Check("unbounded staleness lets delays grow past lock-step's",
                      lambda f: f["max_none"] > f["max_0"]),
                Check("every log replays to the server's parameters, bit for bit",
                      lambda f: f["replay_exact"])),
        figure=_histogram,
        inputs={"workers": WORKERS},
        predict=Predict("Lock-step (S = 0), {workers} workers pulling the same version each clock: what is "
                        "the largest delay, in updates, a gradient can have?", "bound_0",
                        misconceptions=((0, "all three pull the same version, but the server applies their "
                                            "gradients one at a time: the last to land has seen two others "
                                            "applied since its pull"),)),
        hint="In a lock-step clock all three pull the same version; the last of the three to land has seen "
             "the other two applied first.",
        try_this="dplab compare --modes async --staleness-grid 0,2,inf --world-sizes 4 --straggler 3:8",
        explore=Explore("training", lambda f: {"world_size": 4, "staleness": "0,2,inf", "factor": 8}),
        teaches=("staleness", "sync-async"),
    ),
    Step(
        title="Exercise: the SSP gate",
        text=("Now write the gate. `dplab lesson init DIR` copies the exercise stubs into DIR; fill in "
              "`may_proceed(clock, slowest, staleness)` in DIR/ssp_gate.py and run "
              "`dplab lesson check 7 DIR`. It asks your gate on a grid of clocks and bounds, then runs a "
              "parameter server (3 workers, worker 1 slow) whose server asks your gate before answering "
              "each pull, and reads the log for a worker that ran too far ahead.\n\n"
              "The engine's gate, on an example: workers have finished {done} clocks, so the slowest has "
              "finished {slowest}; with staleness 1 the gate opens clock 2 ({open_2:yesno}) and holds "
              "clock 3 (opens: {open_3:yesno}). The stub lets everyone through; checking it as shipped "
              "says:\n\n"
              "> {stub_says}"),
        run=the_gate,
        checks=(Check("the engine's gate opens clock 2 and holds clock 3",
                      lambda f: f["open_2"] and not f["open_3"]),
                Check("the stub fails its check, in the lesson's words",
                      lambda f: not f["stub_passed"] and "may_proceed(" in f["stub_says"])),
        predict=Predict("Workers have finished [3, 1, 2] clocks; staleness 1. Which is the first clock a "
                        "worker must wait for (1, 2 or 3)?", "first_held", choices=("1", "2", "3")),
        hint=SSP_HINTS[0],
        hints=SSP_HINTS[1:],
        try_this="dplab lesson init ex && dplab lesson check 7 ex   # edit ex/ssp_gate.py until it passes",
        exercise="ssp_gate",
        show=("dplab.lessons.exercises.stubs.ssp_gate.may_proceed",),
        teaches=("staleness",),
    ),
)

LESSON = Lesson(7, "async", "Synchronous vs asynchronous training, staleness and SSP",
                "What a parameter server buys (no waiting) and costs (stale gradients); how SSP bounds it.",
                STEPS)
