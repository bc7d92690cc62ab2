"""Checkpoint and resume: kill a real training process, resume it, get the same bits.

The kill is a SIGKILL of the launcher process of ``dplab train`` (its ranks die with it
through PR_SET_PDEATHSIG), once a checkpoint of step >= 4 exists. The resumed run must
end on exactly the parameters of an uninterrupted run (sync), or on a combined log that
replays to its parameters bit for bit (async). Corrupt and foreign checkpoints are
refused with exit code 2, and the killed world leaves nothing in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.backends.local import shm
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import list_checkpoints
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

ROOT = Path(__file__).resolve().parents[1]
STEPS = 120
BASE = ["--world-size", "3", "--steps", str(STEPS), "--hidden", "16", "--num-samples", "256",
        "--global-batch", "32", "--seed", "3"]


def dplab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dplab.backends.cli", "train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def kill_after_checkpoint(ckpt: Path, *args: str, at_least: int = 4) -> int:
    """Start ``dplab train`` checkpointing every 2 steps; SIGKILL it once ckpt >= at_least
    exists."""
    proc = subprocess.Popen([sys.executable, "-m", "dplab.backends.cli", "train", *args,
                             "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = list_checkpoints(ckpt).checkpoints
            if done and int(done[-1].stem.split("-")[1]) >= at_least:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the run ended before it could be killed: make it longer"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stderr.close()
    return proc.pid


def stale_segments(pid: int) -> list[str]:
    return [n for n in shm.leftovers() if n.startswith(f"{shm.PREFIX}{pid}_")]


def test_sync_killed_and_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    slow = ["--straggler", "1:30"]  # slows the run enough to kill it; not part of the arithmetic
    pid = kill_after_checkpoint(tmp_path / "ck", *BASE, *slow)
    last = int(list_checkpoints(tmp_path / "ck").latest.stem.split("-")[1])
    assert 4 <= last < STEPS
    resumed = dplab(
        *BASE,
        "--resume",
        str(tmp_path / "ck"),
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--save-params",
        str(tmp_path / "b.npy"),
        "--json",
        str(tmp_path / "b.json"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert not stale_segments(pid), "the killed world's shared memory must be swept"
    whole = dplab(*BASE, "--save-params", str(tmp_path / "a.npy"))
    assert whole.returncode == 0, whole.stderr
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert np.array_equal(a, b)
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["updates"] == STEPS and row["max_abs_diff_vs_single"] < 1e-10


def test_async_killed_and_resumed_replays_exactly(tmp_path: Path) -> None:
    args = [*BASE, "--mode", "async", "--staleness", "1", "--straggler", "1:30"]
    pid = kill_after_checkpoint(tmp_path / "ck", *args)
    resumed = dplab(*args, "--resume", str(tmp_path / "ck"), "--json", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert not stale_segments(pid)
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    # exactness for async: the combined log (checkpoint's prefix + the resumed run's) replays
    # to the final parameters bit for bit, and every worker's every clock is in it once
    assert row["replay_exact"] is True
    assert row["applied_by_worker"] == {"1": STEPS, "2": STEPS}


def test_resume_api_sync_exact(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=7)
    every = CheckpointConfig(every=3, directory=str(tmp_path))
    whole = launch(train_sync, 3, args=(cfg, SyncConfig(checkpoint=every)))
    assert [p.name for p in list_checkpoints(tmp_path).checkpoints] == ["ckpt-00000003.npz",
                                                                         "ckpt-00000006.npz"]
    again = CheckpointConfig(resume=str(tmp_path / "ckpt-00000003.npz"))
    resumed = launch(train_sync, 3, args=(cfg, SyncConfig(checkpoint=again)))
    for r in resumed:
        assert np.array_equal(r.params, whole[0].params)
    assert resumed[0].losses == whole[0].losses


def test_resume_api_async_combined_log_replays(tmp_path: Path) -> None:
    cfg, ck = TrainConfig(steps=8), str(tmp_path)
    first = launch(train_async, 3, args=(cfg, AsyncConfig(staleness=1, clocks=4,
                                                          checkpoint=CheckpointConfig(3, ck))))
    assert list_checkpoints(ck).latest is not None and len(first[0].log) == 8
    resumed = launch(train_async, 3, args=(cfg, AsyncConfig(staleness=1,
                                                            checkpoint=CheckpointConfig(resume=ck))))
    log = resumed[0].log
    assert sorted((e.worker, e.clock) for e in log) == [(w, c) for w in (1, 2) for c in range(8)]
    assert [e.produced for e in log] == list(range(1, 17))
    assert np.array_equal(replay(cfg, AsyncConfig(staleness=1), log, 2), resumed[0].params)


def test_corrupt_checkpoint_refused_exit_2(tmp_path: Path) -> None:
    every = SyncConfig(checkpoint=CheckpointConfig(2, str(tmp_path)))
    launch(train_sync, 2, args=(TrainConfig(steps=4), every))
    latest = list_checkpoints(tmp_path).latest
    latest.write_bytes(latest.read_bytes()[:-100])  # truncated
    args = ["--world-size", "2", "--steps", "6", "--hidden", "32,32", "--num-samples", "256",
            "--global-batch", "32", "--optimizer", "sgd"]
    out = dplab(*args, "--resume", str(tmp_path))
    assert out.returncode == 2 and "corrupt" in out.stderr, out.stderr
    with pytest.raises(RankError, match="CheckpointError: .* is corrupt"):  # in a rank: named
        launch(train_sync, 2, args=(TrainConfig(steps=6), SyncConfig(
            checkpoint=CheckpointConfig(resume=str(latest)))))


def test_checkpoint_of_other_config_refused_naming_field(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=2)
    launch(train_sync, 2, args=(cfg, SyncConfig(checkpoint=CheckpointConfig(2, str(tmp_path)))))
    other = dataclasses.replace(cfg, steps=4, optimizer=dataclasses.replace(cfg.optimizer, lr=0.5))
    with pytest.raises(Exception, match=r"train\.optimizer\.lr"):
        launch(
            train_sync,
            2,
            args=(other, SyncConfig(checkpoint=CheckpointConfig(resume=str(tmp_path)))),
        )
    small = ["--world-size", "2", "--steps", "2", "--hidden", "8"]
    assert (
        dplab(*small, "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "c")).returncode
        == 0
    )
    out = dplab(*small, "--resume", str(tmp_path / "c"), "--lr", "0.5")
    assert out.returncode == 2 and "meta.train.optimizer.lr" in out.stderr, out.stderr
    out = dplab("--world-size", "2", "--resume", str(tmp_path / "nothing"))
    assert out.returncode == 2 and "cannot read checkpoint" in out.stderr, out.stderr
    (tmp_path / "empty").mkdir()
    out = dplab("--world-size", "2", "--resume", str(tmp_path / "empty"))
    assert out.returncode == 2 and "no checkpoint in" in out.stderr, out.stderr
    assert dplab("--checkpoint-every", "2").returncode == 2  # no directory


def test_checkpoint_config_validation() -> None:
    with pytest.raises(Exception, match="directory"):
        SyncConfig(checkpoint=CheckpointConfig(every=2)).validate()
    with pytest.raises(Exception, match="every"):
        AsyncConfig(checkpoint=CheckpointConfig(every=-1, directory="x")).validate()
