"""``dplab train --zero-stage`` and ``--mixed-precision``: the same runs as the Python API,
checked."""

from __future__ import annotations

import json

import pytest

from dplab.backends.cli.commands import main
from dplab.reference.zero.memory import model_state_bytes

SMALL = ["--world-size", "4", "--steps", "3", "--hidden", "8,8,8,8"]
PSI = (16 * 8 + 8) + 3 * (8 * 8 + 8) + (8 * 4 + 4)  # in 16 -> 8 -> 8 -> 8 -> 8 -> out 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_zero_stage_equals_one_device_and_reports_measured_peaks(tmp_path, capsys, stage):
    out = tmp_path / "z.json"
    assert (
        main(
            ["train", *SMALL, "--zero-stage", str(stage), "--optimizer", "adam", "--json", str(out)]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert f"ring zero-{stage}" in table and "peak_optimizer_bytes" in table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["max_abs_diff_vs_single"] < 1e-12 and row["ranks_identical"]
    formula = model_state_bytes(PSI, stage, 4, param_bytes=8, grad_bytes=8, state_bytes=16)
    # uneven chunks
    assert row["peak_optimizer_bytes"] == pytest.approx(formula.optimizer, abs=16 * 4)
    if stage < 3:
        assert row["peak_params_bytes"] == formula.params  # replicated weights: exactly 8 Psi
    else:
        assert formula.params < row["peak_params_bytes"] < 8 * PSI  # a shard + 2 layers in flight


def test_train_mixed_precision_defaults_to_float32_masters(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert (
        main(
            ["train", *SMALL, "--mixed-precision", "fp16", "--optimizer", "sgd", "--json", str(out)]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert 1e-7 < row["max_abs_diff_vs_single"] < 1e-4  # float16 compute against a float32 run
    # Adam's first step moves every parameter by about lr, whatever its gradient's size: where a
    # gradient is near zero, float16 rounding flips its sign and the two runs part by up to 2 lr.
    mixed = ["train", *SMALL, "--mixed-precision", "fp16"]
    assert main([*mixed, "--optimizer", "adam", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["max_abs_diff_vs_single"] <= 2 * 0.01 + 1e-6
    assert (
        main(
            [
                "train",
                *SMALL,
                "--mixed-precision",
                "fp16",
                "--zero-stage",
                "2",
                "--reduce-dtype",
                "float16",
                "--loss-scale",
                "1024",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["max_abs_diff_vs_single"] < 1e-2 and row["ranks_identical"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--zero-stage", "2", "--algorithm", "tree"],
            "no such schedules: choose one of ring, direct",
        ),
        (["--zero-stage", "3", "--mode", "async"], "without --mode async/backup: drop it"),
        (["--zero-stage", "3", "--straggler", "1:2"], "without --straggler"),
        (["--mixed-precision", "fp16", "--dtype", "float64"], "float32 master weights"),
        (
            ["--mixed-precision", "fp16", "--mode", "async"],
            "mixed precision is for synchronous training",
        ),
        (["--zero-stage", "4"], "invalid choice"),
        (["--loss-scale", "-1"], "a static loss scale must be finite and > 0"),
        (["--loss-scale", "big"], "'dynamic' or a number"),
    ],
)
def test_bad_sharding_options_are_one_line_exit_2(capsys, argv, message):
    try:
        rc = main(["train", *SMALL, *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
