"""``dplab compare --global-batches``: the large-batch sweep's rows, its marks, its defaults, its
errors; and ``dplab train --optimizer lars|lamb --warmup-steps``."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from dplab.backends.cli.args import build_parser
from dplab.backends.cli.args_optim import is_default
from dplab.backends.cli.commands import main
from dplab.backends.cli.sweep import Sweep, sweep_specs
from dplab.backends.runs.run import RunSpec
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig, evaluate, train_single

SMALL = ["--steps", "10", "--base-batch", "8", "--optimizer", "momentum", "--lr", "0.05",
         "--num-samples", "256", "--hidden", "8", "--at-steps", "5,10"]


def oracle_loss(batch: int, lr: float, steps: int) -> float:
    cfg = TrainConfig(MLPConfig(16, (8,), 4, "tanh", "xent"), "classification", 256, batch, steps,
                      OptimConfig("momentum", lr), 0)
    return float(evaluate(cfg, train_single(cfg).params))


def test_sweep_rows_marks_and_the_trade_off(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["compare", "--global-batches", "8,64", "--lr-rule", "linear,sqrt", *SMALL,
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "loss@10steps" in table and "loss@640samples" in table and "lr_rule" in table
    rows = json.loads(out.read_text())["rows"]
    assert [(r["global_batch"], r["lr_rule"]) for r in rows] == [(8, "linear"), (8, "sqrt"),
                                                                 (64, "linear"), (64, "sqrt")]
    lr = {(r["global_batch"], r["lr_rule"]): r["lr"] for r in rows}
    assert lr == {(8, "linear"): 0.05, (8, "sqrt"): 0.05, (64, "linear"): pytest.approx(0.4),
                  (64, "sqrt"): pytest.approx(0.05 * math.sqrt(8))}
    for r in rows:  # every cell sees 10 x 64 samples: batch 8 takes 80 steps
        assert r["samples"] == 640 and r["steps"] == 640 // r["global_batch"]
        assert r["dataset"] == "classification" and r["world_size"] == 2 and r["mode"] == "sync"
        assert r["max_abs_diff_vs_single"] < 1e-12 and r["ranks_identical"] is True
        assert r["loss@640samples"] == r["final_loss"]  # the last step is the data-parallel run's
        b = r["global_batch"]
        for k in (5, 10):  # the marks are the oracle's loss after k steps, and after 320/b steps
            assert r[f"loss@{k}steps"] == pytest.approx(oracle_loss(b, r["lr"], k), rel=1e-12)
        assert r["loss@320samples"] == pytest.approx(oracle_loss(b, r["lr"], 320 // b), rel=1e-12)
    big, small = rows[2], rows[0]  # linear rule
    assert big["loss@10steps"] < 0.5 * small["loss@10steps"]  # per step the big batch wins ...
    assert small["loss@640samples"] < 0.75 * big["loss@640samples"]  # ... per sample it loses


def test_sample_marks_round_up_to_a_whole_step():
    base = RunSpec(train=TrainConfig(steps=4))
    sweep = Sweep((6, 16), ("linear",), 16, at_samples=(20, 64))
    assert sweep.marks(4) == ((1, 4), (20, 64))
    cells = sweep_specs(base, sweep, ["local"], [2], ["ring"])
    assert [(rule, s.train.global_batch, s.train.steps) for rule, s in cells] == [
        ("linear", 6, 11), ("linear", 16, 4)]  # ceil(64 / 6) = 11 steps: 66 samples
    assert cells[0][1].train.optimizer.lr == pytest.approx(0.05 * 6 / 16)
    with pytest.raises(ConfigError, match="--at-steps 5 is past --steps 4"):
        replace(sweep, at_steps=(5,)).marks(4)
    with pytest.raises(ConfigError, match="--at-samples 65 is past the 64 samples"):
        replace(sweep, at_samples=(65,)).marks(4)


def test_sweep_data_defaults_only_when_not_given():
    a = build_parser().parse_args(["compare", "--global-batches", "64"])
    assert is_default(a.dataset) and a.dataset == "regression"  # compare's default, marked
    assert is_default(a.num_samples) and a.num_samples == 1024
    a = build_parser().parse_args(["compare", "--dataset", "regression", "--num-samples", "1024"])
    assert not is_default(a.dataset) and not is_default(a.num_samples)
    a = build_parser().parse_args(["train"])
    assert not is_default(a.dataset)  # train has no sweep


def test_a_given_dataset_is_kept(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        main(
            [
                "compare",
                "--global-batches",
                "16",
                "--dataset",
                "regression",
                "--steps",
                "3",
                "--num-samples",
                "64",
                "--hidden",
                "4",
                "--world-sizes",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["dataset"] == "regression" and row["lr"] == pytest.approx(0.01 * 16 / 64)
    assert row["optimizer"] == "adam" and row["steps"] == 3 and row["world_size"] == 1


@pytest.mark.parametrize("args, message", [
    (["--lr-rule", "sqrt"], "--lr-rule: only for the large-batch sweep; add --global-batches"),
    (["--global-batches", "64", "--modes", "sync,async"], "trains synchronously"),
    (["--global-batches", "64", "--time-budget", "1"], "drop --time-budget"),
    (["--global-batches", "64", "--at-steps", "99", "--steps", "10"], "--at-steps 99 is past "
                                                                      "--steps 10"),
    (["--global-batches", "64", "--lr-rule", "cubic"], "bad lr rule list 'cubic'"),
    (["--global-batches", "0,64"], "give integers >= 1"),
    (["--global-batches", "64", "--base-batch", "0"], "--base-batch: must be an integer >= 1"),
    (["--global-batches", "64", "--warmup-steps", "-1"], "--warmup-steps: must be an integer >= 0"),
])
def test_bad_sweep_input_is_one_line_exit_2(args, message, capsys):
    try:
        rc = main(["compare", *args])
    except SystemExit as e:  # argparse's own checks exit from the parser
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("optimizer, lr", [("lamb", "0.01"), ("lars", "5")])
def test_train_with_layerwise_optimizer_and_warmup(optimizer, lr, tmp_path, capsys):
    out = tmp_path / "row.json"
    assert (
        main(
            [
                "train",
                "--world-size",
                "2",
                "--steps",
                "6",
                "--hidden",
                "8",
                "--optimizer",
                optimizer,
                "--lr",
                lr,
                "--warmup-steps",
                "3",
                "--trust-coef",
                "0.01",
                "--weight-decay",
                "0.001",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["max_abs_diff_vs_single"] < 1e-12
    cfg = TrainConfig(
        MLPConfig(16, (8,), 4),
        "regression",
        1024,
        64,
        6,
        OptimConfig(optimizer, float(lr), weight_decay=0.001, warmup_steps=3, trust_coef=0.01),
    )
    single = train_single(cfg)
    assert row["final_loss"] == pytest.approx(evaluate(cfg, single.params), rel=1e-12)
    assert row["final_loss"] < single.losses[0]
    assert not np.isnan(row["final_loss"])
