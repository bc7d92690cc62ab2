"""Resuming refuses, in one line and exit code 2, what it cannot continue exactly.

A checkpoint past this run's last step (it would hand back later parameters under a
smaller step count); a file whose checksum holds but whose parts contradict each other
(parameters, optimizer state, step, data position); and a change of backend, world size
or algorithm, all under one rule: refuse, as for any other change of configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.cli.commands import main
from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference.checkpoint.store import load_checkpoint, save_checkpoint

SMALL = ["--world-size", "2", "--hidden", "8", "--num-samples", "64", "--global-batch", "16"]


def train(*args: str) -> int:
    return main(["train", *SMALL, *args])


def one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("dplab train: error: ") and "\n" not in err, err
    return err


@pytest.fixture
def ckpt(tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    """A sync checkpoint of step 4 of the SMALL run (local backend, ring)."""
    assert (
        train("--steps", "4", "--checkpoint-every", "4", "--checkpoint-dir", str(tmp_path / "ck"))
        == 0
    )
    capsys.readouterr()
    return tmp_path / "ck"


def test_fewer_steps_than_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path, capsys) -> None:
    assert train("--steps", "2", "--resume", str(ckpt)) == 2
    err = one_line_error(capsys)
    assert "at step 4, past this run's 2: resume with --steps 4 or more" in err
    out = tmp_path / "row.json"
    # as many: nothing to do
    assert train("--steps", "4", "--resume", str(ckpt), "--json", str(out)) == 0
    assert json.loads(out.read_text())["rows"][0]["updates"] == 4


def test_async_fewer_clocks_than_the_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    args = ["--mode", "async", "--staleness", "0"]
    assert (
        train(*args, "--steps", "4", "--checkpoint-every", "4", "--checkpoint-dir", str(tmp_path))
        == 0
    )
    capsys.readouterr()
    assert train(*args, "--steps", "3", "--resume", str(tmp_path)) == 2
    assert "at clock (per worker) 4, past this run's 3" in one_line_error(capsys)


def _rewrite(src: Path, dst: Path, **change) -> None:
    """A copy of ``src``'s latest checkpoint with some parts changed, under a valid checksum."""
    c = load_checkpoint(src)
    parts = {"step": c.step, "params": c.params, "optimizer_state": c.optimizer_state,
             "data_position": c.data_position, "rng_state": c.rng_state, "meta": c.meta} | change
    save_checkpoint(dst, **parts)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda c: {"params": c.params.astype(np.float32)}, "parameters float32"),
        (lambda c: {"params": c.params[:-1]}, "parameters float64"),
        (
            lambda c: {
                "optimizer_state": c.optimizer_state | {"exp_avg": c.optimizer_state["exp_avg"][:3]}
            },
            "optimizer 'exp_avg'",
        ),
        (lambda c: {"optimizer_state": c.optimizer_state | {"step": 9}}, "optimizer took 9 steps"),
        (lambda c: {"data_position": c.data_position | {"step": 2}}, "data position 2"),
        (
            lambda c: {"step": 2, "data_position": c.data_position | {"step": 2}},
            "optimizer took 4 steps",
        ),
    ],
)
def test_a_checkpoint_that_contradicts_itself_is_refused(
    ckpt, tmp_path, capsys, change, says
) -> None:
    _rewrite(ckpt, tmp_path / "bad", **change(load_checkpoint(ckpt)))
    assert train("--steps", "6", "--resume", str(tmp_path / "bad")) == 2
    err = one_line_error(capsys)
    assert "contradicts itself" in err and says in err, err


def test_a_consistent_rewrite_is_still_accepted(ckpt: Path, tmp_path: Path) -> None:
    _rewrite(ckpt, tmp_path / "same")  # guards the test above: rewriting alone breaks nothing
    assert train("--steps", "6", "--resume", str(tmp_path / "same")) == 0


@pytest.mark.parametrize("args, field", [
    (["--backend", "mpi"], "meta.backend: checkpoint has local, this run has mpi"),
    (["--backend", "torch"], "meta.backend: checkpoint has local, this run has torch"),
    (["--algorithm", "tree"], "meta.sync.algorithm"),
    (["--world-size", "3"], "meta.world_size"),
])
def test_another_backend_world_size_or_algorithm_is_refused(ckpt, capsys, args, field) -> None:
    if "--backend" in args:
        try:
            check_backend(args[1])
        except BackendUnavailable as e:
            pytest.skip(str(e))
    assert train("--steps", "6", "--resume", str(ckpt), *args) == 2
    err = one_line_error(capsys)
    assert field in err and "resume with the same configuration" in err, err


def test_the_checkpoint_records_backend_world_size_and_algorithm(ckpt: Path) -> None:
    meta = load_checkpoint(ckpt).meta
    assert (meta["backend"], meta["world_size"], meta["sync"]["algorithm"]) == ("local", 2, "ring")
