"""Lesson 9: checkpoints, exact resume, and a lost worker.

    dplab lesson 9

Four steps: stop a run at step 10 and resume it to 20, bitwise equal to a run that never
stopped; open a checkpoint and see what it must hold (and what happens without the optimizer
state); kill a parameter-server worker and watch the server go on; kill a rank of synchronous
training, read the error, and resume from the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from dplab.backends import RankError, launch
from dplab.backends.launch.world import RankLost
from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from dplab.reference.data import batch_indices
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

# Adam keeps two arrays per parameter and a step count: state that a resume must bring back
TRAIN = TrainConfig(model=MLPConfig(hidden=(32, 32)), steps=20, optimizer=OptimConfig("adam", lr=0.01))


def train_to(lab, steps, directory, resume=False):
    """Train TRAIN for ``steps`` steps on 4 ranks, checkpointing every
    5; return rank 0's parameters."""
    ckpt = CheckpointConfig(every=5, directory=directory,
                            resume=directory if resume else None)
    spec = RunSpec(world_size=4, train=replace(TRAIN, steps=steps),
                   checkpoint=ckpt)
    out = Path(directory) / "final.npy"
    run_train(spec, world=lab.world(4), save_params=str(out))
    return np.load(out)


def stop_and_resume(lab):
    tmp = tempfile.TemporaryDirectory
    with tmp() as stopped, tmp() as straight:
        # the run stops after step 10 ...
        train_to(lab, 10, stopped)
        saved = [p.name for p in list_checkpoints(stopped).checkpoints]
        # ... and a new one picks up there
        resumed = train_to(lab, 20, stopped, resume=True)
        uninterrupted = train_to(lab, 20, straight)
    diff = float(np.abs(resumed - uninterrupted).max())
    verdict = ("identical" if diff == 0
               else "close" if diff < 1e-10 else "different")
    return {"saved": ", ".join(saved), "diff": diff,
            "identical": bool(np.array_equal(resumed, uninterrupted)),
            "verdict": verdict}


def inside_a_checkpoint(lab):
    tmp = tempfile.TemporaryDirectory
    with tmp() as d, tmp() as forgetful:
        train_to(lab, 10, d)
        # the latest: step 10
        ckpt = load_checkpoint(d)
        # the same checkpoint with Adam's moments forgotten (zeroed),
        # as a resume that kept only the weights
        zeroed = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v)
                  for k, v in ckpt.optimizer_state.items()}
        save_checkpoint(forgetful, ckpt.step, ckpt.params, zeroed,
                        ckpt.data_position, ckpt.rng_state, ckpt.meta)
        right = train_to(lab, 20, d, resume=True)
        wrong = train_to(lab, 20, forgetful, resume=True)
        raw = bytearray(Path(ckpt.path).read_bytes())
        # one flipped bit in the middle of the file
        raw[len(raw) // 2] ^= 1
        Path(ckpt.path).write_bytes(raw)
        try:
            load_checkpoint(ckpt.path)
            refused = ""
        except CheckpointError as e:
            refused = str(e)
    n, B, seed = TRAIN.num_samples, TRAIN.global_batch, TRAIN.seed
    batch = batch_indices(n, B, step=10, seed=seed)
    again = batch_indices(n, B, step=10, seed=seed)
    state = ckpt.optimizer_state
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    return {"step": ckpt.step,
            "n_params": ckpt.params.size,
            "opt_arrays": ", ".join(sorted(arrays)),
            "n_opt_arrays": len(arrays),
            "opt_step": state["step"],
            "position": ckpt.data_position["step"],
            "losses": len(ckpt.data_position["losses"]),
            "rng": repr(ckpt.rng_state),
            "rng_said": "the file's RNG slot is empty" if ckpt.rng_state is None else "it holds one",
            "same_batch": bool(np.array_equal(batch, again)),
            "forgot_diff": float(np.abs(right - wrong).max()),
            "refused": refused,
            "opt_bytes": sum(v.nbytes for v in arrays.values()),
            "param_bytes": ckpt.params.nbytes}


def traced_async(comm, cfg, acfg):
    comm.tracer.enabled = True
    return train_async(comm, cfg, acfg)


def worker_dies(lab):
    cfg = replace(TRAIN, steps=10)
    # worker 2 is SIGKILLed as it starts clock 4
    acfg = AsyncConfig(staleness=1, kill_at=(2, 4))
    results = launch(traced_async, 4, args=(cfg, acfg),
                     tolerate=frozenset({1, 2, 3}))
    server, dead = results[0], results[2]
    lost = isinstance(dead, RankLost)
    applied = {w: sum(e.worker == w for e in server.log) for w in (1, 2, 3)}
    in_words = ", ".join(f"worker {w}: {n}" for w, n in applied.items())
    again = replay(cfg, acfg, server.log, 3)
    return {"lost": server.lost,
            "lost_clocks": dict(server.lost).get(2),
            "applied": applied,
            "applied_2": applied[2],
            "applied_text": in_words,
            "clocks": cfg.steps,
            "rank_lost": lost,
            "how": dead.detail.strip().splitlines()[-1] if lost else "",
            "gate_held": all(e.clock - e.slowest_done <= acfg.staleness
                             for e in server.log),
            "replay_exact": bool(np.array_equal(again, server.params)),
            "events": [r.events for r in results
                       if not isinstance(r, RankLost)]}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    return timeline_figure([e for rank in facts["events"] for e in rank],
                           title="worker 2 (rank 2) dies at clock 4; the server goes on")


def rank_dies(comm, cfg, sync, after):
    """Every rank trains; rank 1 dies as a crash does (SIGKILL: no
    goodbye) after ``after`` steps."""
    if comm.rank == 1:
        train_sync(comm, replace(cfg, steps=after), sync)
        os.kill(os.getpid(), signal.SIGKILL)
    return train_sync(comm, cfg, sync)


def crash_and_resume(lab):
    tmp = tempfile.TemporaryDirectory
    with tmp() as d, tmp() as straight:
        ckpt = CheckpointConfig(every=5, directory=d)
        sync = SyncConfig(checkpoint=ckpt)
        try:
            launch(rank_dies, 4, args=(TRAIN, sync, 13), timeout=20)
            error = None
        except RankError as e:
            error = e
        # where the resumed run starts
        last = load_checkpoint(d).step
        resumed = train_to(lab, 20, d, resume=True)
        uninterrupted = train_to(lab, 20, straight)
    if error is None:
        rank, said = None, ""
    else:
        lines = str(error).splitlines()
        rank, said = error.rank, " ".join(s.strip() for s in lines)
    return {"after": 13, "every": 5,
            "failed": error is not None,
            "failed_rank": rank,
            "error": said,
            "last": last,
            "identical": bool(np.array_equal(resumed, uninterrupted))}


STEPS = (
    Step(
        title="Stop at step 10, resume, same bits",
        text=("Four ranks train with Adam, checkpointing every 5 steps; the run stops after step 10. A new "
              "run of 20 steps resumes from the directory ({saved}): it loads the latest checkpoint on every "
              "rank and goes on from step 10. Its final parameters are **{verdict}** to a run that never "
              "stopped: max difference {diff:g}, the same bits ({identical}). Not close: identical, "
              "because the resumed steps do the same operations on the same bits."),
        run=stop_and_resume,
        checks=(Check("the resumed run equals the uninterrupted run bit for bit", lambda f: f["identical"]),),
        predict=Predict("A run stops at step 10 and resumes to 20. Its parameters against a run that never "
                        "stopped: 'identical', 'close' or 'different'?", "verdict",
                        choices=("identical", "close", "different")),
        hint="What could differ? Only what the checkpoint failed to bring back.",
        show=("dplab.reference.checkpoint.resume.save_state",),
        try_this=("dplab train --steps 10 --checkpoint-every 5 --checkpoint-dir ck && "
                  "dplab train --steps 20 --checkpoint-every 5 --checkpoint-dir ck --resume ck"),
        teaches=("faults",),
    ),
    Step(
        title="What a checkpoint holds",
        text=("The checkpoint of step {step}: the {n_params:,} parameters ({param_bytes:,} bytes), Adam's "
              "state ({opt_arrays}: {opt_bytes:,} bytes, twice the weights, and its step count "
              "{opt_step}), the data position (step {position}, and the {losses} losses so far, so that "
              "the resumed run reports the whole run), and no RNG state ({rng_said}), because nothing "
              "here draws from a running generator: the batch of step t is a pure function of (seed, t), "
              "the same every time it is asked for ({same_batch}). A trainer that shuffles or drops out "
              "with a stateful generator must save its state too.\n\n"
              "Forget the optimizer state (the same file with Adam's moments zeroed) and the resumed run "
              "ends **{forgot_diff:.2g}** away from the right one. And the file is checksummed: one "
              "flipped bit and it is refused, never half loaded:\n\n> {refused}"),
        run=inside_a_checkpoint,
        checks=(Check("the checkpoint holds the parameters, Adam's two moments and its step count",
                      lambda f: f["opt_arrays"] == "exp_avg, exp_avg_sq" and f["opt_step"] == f["step"]),
                Check("no RNG state is needed: the batch of a step is the same whenever it is drawn",
                      lambda f: f["rng"] == "None" and f["same_batch"]),
                Check("without the optimizer state the resumed run goes elsewhere (> 1e-6)",
                      lambda f: f["forgot_diff"] > 1e-6),
                Check("a checkpoint with one flipped bit is refused", lambda f: "checksum" in f["refused"])),
        predict=Predict("Adam's state: how many arrays, each the size of the weights, must a checkpoint "
                        "keep for it?", "n_opt_arrays",
                        misconceptions=((1, "Adam keeps two running means: of the gradient and of its "
                                         "square"),
                                        (0, "the weights alone resume a plain SGD run, not an Adam one: "
                                         "see what forgetting them costs below"))),
        show=("dplab.reference.checkpoint.store.save_checkpoint",),
        hint="Adam's update divides a running mean of the gradient by a running mean of its square.",
        try_this="python -c \"import numpy as np; print(np.load('ck/ckpt-00000010.npz').files)\"",
        teaches=("faults",),
    ),
    Step(
        title="A lost worker: the parameter server goes on",
        text=("A parameter server with 3 workers and staleness 1; worker 2 is killed (SIGKILL) as it "
              "starts clock 4 of {clocks}. The launcher reports rank 2 lost, not failed (*{how}*); the "
              "server notices the silence, asks the transport who is alive, records worker 2 as lost "
              "after {lost_clocks} clocks, and stops counting it in the SSP gate, so nobody waits for the "
              "dead. Gradients applied: {applied_text}. The gate held over the living ({gate_held}), "
              "and the log still replays on one device to the server's parameters, bit for bit "
              "({replay_exact})."),
        run=worker_dies,
        checks=(Check("the dead worker is a RankLost, not a failed run", lambda f: f["rank_lost"]),
                Check("the server records worker 2 lost after 4 clocks", lambda f: f["lost"] == [(2, 4)]),
                Check("the living workers finished every clock",
                      lambda f: f["applied"][1] == f["applied"][3] == f["clocks"]),
                Check("the log replays exactly", lambda f: f["replay_exact"])),
        figure=_timeline,
        predict=Predict("Worker 2 dies as it starts clock 4 (clocks count from 0). How many of its gradients "
                        "did the server apply?", "applied_2"),
        hint="Clocks 0, 1, 2 and 3 were pushed before it died.",
        show=("dplab.reference.ps.server.Server.lose", "dplab.reference.ps.gate.Gate.forget"),
        try_this="dplab train --mode async --world-size 4 --staleness 1   # then kill -9 one worker's pid",
        teaches=("faults",),
    ),
    Step(
        title="A lost rank in sync training: fail, then resume",
        text=("Synchronous training cannot go on without a rank: every step needs every gradient. Four "
              "ranks checkpoint every {every} steps; rank 1 dies (SIGKILL) after step {after}. The others "
              "wait in the next all-reduce for a gradient that never comes; the launcher sees rank 1's "
              "process gone, stops them, and raises one error naming it (rank {failed_rank}):\n\n"
              "> {error}\n\n"
              "Nothing is lost but the steps after the last checkpoint: the new run resumes from step "
              "{last} and ends on the same bits as a run that never crashed ({identical})."),
        run=crash_and_resume,
        checks=(Check("the crashed run fails, naming rank 1",
                      lambda f: f["failed"] and f["failed_rank"] == 1),
                Check("the resumed run starts from the last checkpoint before the crash",
                      lambda f: f["last"] == f["after"] // f["every"] * f["every"]),
                Check("and ends bitwise equal to an uninterrupted run", lambda f: f["identical"])),
        inputs={"every": 5, "after": 13},
        predict=Predict("Checkpoints every {every} steps; rank 1 dies after step {after}. From which step "
                        "does the resumed run go on?", "last",
                        misconceptions=((13, "only what a checkpoint holds survives a crash: the steps "
                                         "after the last one are done again"),
                                        (15, "the checkpoint of step 15 was never written: the run died "
                                         "at 13"))),
        hint="Only complete checkpoints count, and they are written at multiples of the interval.",
        try_this="dplab train --world-size 4 --steps 200 --checkpoint-every 20 --checkpoint-dir ck   "
                 "# kill -9 a rank, then add --resume ck",
        teaches=("faults",),
    ),
)

LESSON = Lesson(9, "faults", "Checkpoints, exact resume, a lost worker",
                "What a checkpoint must hold to resume bit for bit, and what a dead worker or rank costs.",
                STEPS)
