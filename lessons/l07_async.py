"""Lesson 7: synchronous vs asynchronous training, staleness and stale synchronous parallel (SSP).

    dplab lesson 7

Five steps: give both kinds of training the same wall time with one late worker and count what
each applied, and their loss against samples seen; what a gradient's delay costs per sample
(statistical efficiency, from replayed logs); bound how far ahead of the slowest a worker may run
(SSP, in clocks); read the
delay histogram from the server's log (in updates) and replay the log to the same bits; then
write the SSP gate yourself (the exercise ``ssp_gate``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import numpy as np

from dplab.backends.runs.run import RunSpec
from dplab.lessons.exercises import STUBS, check_file
from dplab.lessons.exercises.ssp import HINTS as SSP_HINTS
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLPConfig
from dplab.reference.ps.gate import gate_open
from dplab.reference.ps.protocol import LogEntry
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async, worker_batch
from dplab.reference.train.single import TrainConfig, evaluate, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

TRAIN = TrainConfig(model=MLPConfig(hidden=(64, 64)), global_batch=128, num_samples=512, steps=20)
LATE = 0.05                                    # seconds the late worker sleeps before each batch
BUDGET = 0.4                                   # seconds of wall time each run gets in step 1
LATE_STEPS = 3                                 # the sleep is at least this many measured sync steps
SSP_LATE = 0.01                                # steps 2 and 3: worker 1's lateness before each clock
WORKERS = 3                                    # world of 4: rank 0 serves, ranks 1..3 compute


def same_wall_time(lab):
    world, cfg = lab.world(4), replace(TRAIN, steps=500)  # the budget stops it
    world.run(train_sync, replace(cfg, steps=1))  # warm-up (imports), untimed
    # the handicap, not these cores' load, must decide the race: LATE, or the
    # time of LATE_STEPS steps where busy cores are slower; the budget follows
    start = time.perf_counter()
    world.run(train_sync, replace(cfg, steps=LATE_STEPS))
    late_s = max(LATE, time.perf_counter() - start)
    budget, late = BUDGET * late_s / LATE, (0.0, 0.0, 0.0, late_s)
    sync = world.run(train_sync, cfg,
                     SyncConfig(delays=late, time_budget_s=budget))[0]
    ps = world.run(train_async, cfg, AsyncConfig(
        staleness=None, delays=late[1:], time_budget_s=budget))[0]
    steps = len(sync.losses)
    sync_samples = steps * cfg.global_batch
    ps_samples = sum(len(worker_batch(cfg, e.worker, WORKERS, e.clock))
                     for e in ps.log)
    ratio, sync_loss = ps_samples / sync_samples, evaluate(cfg, sync.params)
    # one device, as many steps
    single = train_single(replace(cfg, steps=steps)).params
    again = replay(cfg, AsyncConfig(staleness=None), ps.log, WORKERS)
    lab.scratch["l07_log"] = ps.log
    # loss against samples seen: sync after each step, async after each update
    sync_curve = [(k, evaluate(cfg, train_single(replace(cfg, steps=k)).params)
                   ) for k in range(1, steps + 1)]
    async_curve = samples_curve(cfg, ps.log, dense=steps)
    # nan where async saw fewer samples than sync (cores too loaded to race):
    # the first check then fails naming its claim, not StopIteration
    at_sync = next((loss for seen, loss in async_curve if seen >= steps),
                   float("nan"))
    return {"budget": budget, "late_ms": late_s * 1e3,
            "late_floor_ms": LATE * 1e3, "batch": cfg.global_batch,
            "sync_steps": steps, "sync_step_ms": budget * 1e3 / steps,
            "sync_samples": sync_samples, "async_samples": ps_samples,
            "ratio": ratio, "sync_loss": sync_loss,
            "async_loss": evaluate(cfg, ps.params),
            "late_share": sum(e.worker == 3 for e in ps.log) / len(ps.log),
            "more": "async" if ps_samples > sync_samples else "sync",
            "sync_vs_single": float(np.abs(sync.params - single).max()),
            "sync_curve": sync_curve, "async_curve": async_curve,
            "async_at_sync": at_sync,
            "per_sample": _per_sample_said(at_sync, sync_loss, ratio),
            "replay_exact": bool(np.array_equal(again, ps.params))}


def samples_curve(cfg, log, fresh=False, dense=8):
    """(global batches of samples applied, loss) along a replayed log:
    loss against samples seen, not against time. Every update up to
    ``dense`` global batches, then about 40 points more."""
    seen, curve, stride = [0], [], max(1, len(log) // 40)

    def after(update, params):
        entry = log[update - 1]
        seen[0] += len(worker_batch(cfg, entry.worker, WORKERS, entry.clock))
        if seen[0] <= (dense + 1) * cfg.global_batch or update % stride == 0:
            curve.append((seen[0] / cfg.global_batch, evaluate(cfg, params)))

    replay(cfg, AsyncConfig(staleness=None), log, WORKERS, fresh, after)
    return curve


def _per_sample_said(async_loss, sync_loss, ratio):
    """What async's loss at sync's samples says, in words."""
    if abs(async_loss / sync_loss - 1) <= 0.25:
        return (f"within 25% of sync's {sync_loss:.4f}: per sample the two are about even, "
                f"and async's lower final loss comes from the {ratio:.1f}x samples it saw "
                "in the same time")
    if async_loss < sync_loss:
        return (f"below sync's {sync_loss:.4f}: each of its updates uses a third of the "
                "batch, so it takes three times the updates per sample, and here that "
                "outweighed their staleness")
    return (f"above sync's {sync_loss:.4f}: per sample its stale gradients did worse, and "
            f"its lower final loss comes only from the {ratio:.1f}x samples it saw")


DELAYS = (0, 2, 16, 32)     # step 2: a gradient computed this many updates ago
TARGET = 0.06              # step 2's loss to reach
GLOBALS = 40               # step 2's budget, in global batches of samples


def delayed_log(updates, delay):
    """A server log in which every gradient was computed ``delay``
    updates ago (round-robin workers): a what-if for replay."""
    return [LogEntry(worker=k % WORKERS + 1, clock=k // WORKERS,
                     version=max(0, k - delay), produced=k + 1,
                     slowest_done=0)
            for k in range(updates)]


def stale_per_sample(lab):
    updates = GLOBALS * WORKERS          # each update: one worker's shard
    curves, reach = {}, {}
    for d in DELAYS:
        curve = samples_curve(TRAIN, delayed_log(updates, d), dense=GLOBALS)
        curves[d] = curve
        reach[d] = next((x for x, loss in curve if loss <= TARGET), None)
    run = lab.scratch.get("l07_log", [])
    last = {d: c[-1][1] for d, c in curves.items()}
    table = "\n".join(
        f"| {d} | {'not within ' + str(GLOBALS) if reach[d] is None else f'{reach[d]:.1f}'} "
        f"| {last[d]:.3f} |" for d in DELAYS)
    big = DELAYS[-1]
    return {"curves": curves, "reach": reach, "last": last, "table": table,
            "target": TARGET, "globals": GLOBALS, "batch": TRAIN.global_batch,
            "workers": WORKERS, "big": big, "mid": DELAYS[2], "small": DELAYS[1],
            "last_big": last[big], "last_fresh": last[0],
            "run_said": _run_delays_said(run),
            "big_more": "more" if reach[big] is None or reach[big] > reach[0] else "fewer"}


def _run_delays_said(log):
    """Step 1's delays, in words: the median, and whose was the largest."""
    if not log:
        return "Step 1's run is not in this session (run the lesson from step 1 to see its delays)."
    worst = max(log, key=lambda e: e.delay)
    median = float(np.median([e.delay for e in log]))
    whose = "the late worker's" if worst.worker == WORKERS else f"worker {worst.worker}'s"
    return (f"Step 1's run had a median delay of {median:g} update{'' if median == 1 else 's'}; "
            f"the largest, {worst.delay}, was {whose}.")


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


def _curves_figure(curves, title):
    """The Training page's loss figure, one line per (label, [(batches, loss)])."""
    from dplab.viz.training import loss_figure
    from dplab.viz.training_runs import Cell
    cells = [Cell(RunSpec(world_size=4, train=TRAIN), {"algorithm": label, "straggler": "none"},
                  [x for x, _ in curve], [0.0] * len(curve), [y for _, y in curve])
             for label, curve in curves]
    fig = loss_figure(cells, "step")
    fig.update_layout(title=title)
    return fig


def _per_sample(facts):
    return _curves_figure([("sync", facts["sync_curve"]), ("async", facts["async_curve"])],
                          "loss against samples seen (global batches of samples applied)")


def _stale_figure(facts):
    return _curves_figure([(f"delay {d}", c) for d, c in facts["curves"].items()],
                          "loss against samples seen, by the gradients' delay")


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
        text=("Four ranks, {budget:.1f} s of wall time each way, and rank 3 starts every batch "
              "{late_ms:.0f} ms late. **Synchronous** training (all-reduce) ends a step only when the "
              "last gradient arrives: it managed {sync_steps} steps, {sync_samples:,} samples, and it is "
              "still one device's SGD (parameters {sync_vs_single:.1e} from it). **Asynchronous** training "
              "through a parameter server (rank 0 serves, ranks 1-3 pull, compute, push; nobody waits: "
              "staleness inf, `--staleness inf`) applied "
              "**{async_samples:,} samples, {ratio:.1f}x as many**, and reached a "
              "loss of {async_loss:.4f} against sync's {sync_loss:.4f}. More samples in the same time is "
              "what async buys; whether each sample did as much is a separate question, answered by "
              "loss against samples seen (the figure: sync after each step, async replayed from its log "
              "after each update, both in global batches of {batch} samples). At the {sync_samples:,} "
              "samples sync saw, async's loss was {async_at_sync:.4f}, {per_sample}. (A sync step took "
              "{sync_step_ms:.0f} ms, {late_ms:.0f} of them the late rank's sleep: the race is decided "
              "by the handicap, not by the noise of these shared cores. The sleep is {late_floor_ms:.0f} ms, or "
              "the time of three unhandicapped sync steps when busy cores make that longer, and "
              "the wall time grows with it.)\n\n"
              "The price: the late worker's gradients are only {late_share:.0%} of those applied (its shard "
              "of each batch is seen rarely), and every gradient was computed on parameters that others "
              "had already moved. The run is not any one device's SGD, but it is exactly what its log "
              "says: replaying the log on one device gives the same bits ({replay_exact})."),
        run=same_wall_time,
        checks=(Check("in the same wall time async applies more than twice the samples",
                      lambda f: f["ratio"] > 2),
                Check("and reaches a lower loss than sync", lambda f: f["async_loss"] < f["sync_loss"]),
                Check("what the text says of the loss per sample is what the curves show",
                      lambda f: f["per_sample"] == _per_sample_said(
                          f["async_at_sync"], f["sync_curve"][-1][1], f["ratio"])),
                Check("the late rank's sleep is most of a sync step",
                      lambda f: f["sync_step_ms"] < 2 * f["late_ms"]),
                Check("the late worker's share of the applied gradients is under a third",
                      lambda f: f["late_share"] < 1 / 3),
                Check("sync stays single-device SGD (< 1e-12)", lambda f: f["sync_vs_single"] < 1e-12),
                Check("the async run replays exactly from its log", lambda f: f["replay_exact"])),
        inputs={"late_floor_ms": LATE * 1e3},
        figure=_per_sample,
        predict=Predict("Rank 3 starts every batch at least {late_floor_ms:.0f} ms late. In the same wall "
                        "time, which applies more samples: 'sync' or 'async'?", "more", choices=("sync", "async")),
        hint="A synchronous step needs every rank's gradient; a parameter server applies each as it comes.",
        try_this="dplab compare --modes sync,async --world-sizes 4 --straggler 3:8 --time-budget 1",
        explore=Explore("training", lambda f: {"world_size": 4, "steps": 20, "staleness": "0,2,inf"}),
        teaches=("sync-async",),
    ),
    Step(
        title="Per sample, a stale gradient is worth less",
        text=("Async's gain is samples per second; its cost is paid per sample. A gradient that was "
              "computed on parameters {small}, {mid} or {big} updates old points where the loss went "
              "down *then*. To see what that costs alone, replay a server log (the same tool that "
              "reproduced step 1's run) built so that every gradient is that many updates old: "
              "{workers} workers in turn, the same batches in the same order, only the delay differs. "
              "Samples to reach a loss of {target} (in global batches of {batch}) and the loss after "
              "{globals}:\n\n"
              "| delay (updates) | global batches to {target} | loss after {globals} |\n"
              "|---|---|---|\n{table}\n\n"
              "A small delay costs next to nothing, and early on it can even help: a stale gradient "
              "adds to the step much as momentum does (Mitliagkas et al. 2016). A large one costs "
              "samples, then stability: at delay {big} the loss swings and ends at {last_big:.3f} "
              "against {last_fresh:.3f} fresh. That is **statistical efficiency**: the same samples "
              "buy less progress, and it must be read against samples seen (the figure), not against "
              "time, where async's extra samples hide it. {run_said} Many workers, or one slow one, "
              "make delays large, which is why SSP (next step) bounds them."),
        run=stale_per_sample,
        checks=(Check("fresh gradients (delay 0) reach {target} within {globals} global batches",
                      lambda f: f["reach"][0] is not None),
                Check("a small delay costs at most 25% more samples",
                      lambda f: f["reach"][f["small"]] is not None
                      and f["reach"][f["small"]] <= 1.25 * f["reach"][0]),
                Check("a large delay costs more samples than fresh gradients, or never gets there",
                      lambda f: all(f["reach"][d] is None or f["reach"][d] > f["reach"][0]
                                    for d in (f["mid"], f["big"]))),
                Check("at the largest delay the loss ends over 3x the fresh one",
                      lambda f: f["last_big"] > 3 * f["last_fresh"])),
        figure=_stale_figure,
        inputs={"big": DELAYS[-1], "target": TARGET},
        predict=Predict("Every gradient computed {big} updates before it is applied: to reach a loss of "
                        "{target}, does training need 'fewer', 'about the same' or 'more' samples than "
                        "with fresh gradients?", "big_more", choices=("fewer", "about the same", "more"),
                        misconceptions=(("about the same", "a stale gradient points where the loss went "
                                                           "down {big} updates ago; the further the "
                                                           "parameters moved since, the less it helps"),)),
        hint="The gradient is right for parameters that are no longer there.",
        hints=("Small delays are nearly free; large ones overshoot, like an lr that is too large.",),
        show=(delayed_log, "dplab.reference.ps.replay.replay"),
        try_this="Set DELAYS to (0, 2, 8, 24) in l07_async.py: where does the cost start?",
        teaches=("sync-async", "async-efficiency"),
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
