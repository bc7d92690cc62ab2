"""Inputs that used to go wrong in silence now stop in one line (issue 18).

- two ``ZeroRedundancyOptimizer``s over the same parameters: the older one's ``step()`` refuses;
- a tune file with values ``dplab tune`` never writes (negative, zero, NaN, a string): refused at
  load, naming the file and the field;
- ``--loss-scale`` / ``--reduce-dtype`` without ``--mixed-precision`` refused at parsing; a loss
  scale outside float32; a static scale that overflows, or a run that diverges, stops with an error.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from dplab.backends.cli.args import build_parser
from dplab.backends.cli.commands import main
from dplab.reference import auto
from dplab.reference.costfit import CostFit
from dplab.reference.errors import ConfigError
from dplab.reference.precision import LossScaler, MixedPrecision

SMALL = ["--world-size", "2", "--steps", "3"]


# -- 1. ZeRO: one optimizer per parameter --------------------------------------------------------

def _two_zeros(comm) -> dict:
    import torch

    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    old = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm, lr=0.1)
    # a fresh one: fine
    new = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm, lr=0.1)
    x = torch.ones(4, 3, dtype=torch.float64)
    out = {}
    for name, opt in (("old", old), ("new", new)):
        before = model.weight.detach().clone()
        opt.zero_grad()
        model(x).sum().backward()
        try:
            opt.step()
            out[name] = not torch.equal(before, model.weight.detach())  # True: it moved the weights
        except ConfigError as e:
            out[name] = str(e)
    return out


@pytest.mark.torch
def test_the_older_of_two_zeros_over_the_same_parameters_refuses_to_step(worlds):
    pytest.importorskip("torch")
    for r in worlds(2).run(_two_zeros):
        assert r["new"] is True  # the newest steps the module's weights
        assert (
            "\n" not in r["old"]
            and "taken over by a ZeroRedundancyOptimizer built later" in r["old"]
        )
        assert "step only the newest optimizer" in r["old"]


# -- 2. the tune file auto reads -------------------------------------------------------------------

def _tune_file(tmp_path):
    fits = (CostFit("local", "all", "all", 44e-6, 0.0, 1 / 5.8e9),
            CostFit("local", "all", "native", 95e-6, 1 / 5.2e9, None),
            CostFit("local", 4, "ring", 40e-6, 2e-10, None))
    measured = (("local", 4, "ring", 4096, 100e-6), ("local", 4, "native", 4096, 200e-6))
    path = auto.save_tuning(auto.Tuning(fits, "test", measured), tmp_path / "tune.json")
    return path, json.loads(path.read_text())


def _set(data, where, value):
    *keys, last = where
    for k in keys:
        data = data[k]
    data[last] = value


@pytest.mark.parametrize("where, value, field", [
    (("fits", 0, "alpha_s"), -4.4e-05, "fits[0] (local, all, all).alpha_s is -4.4e-05"),
    (("fits", 1, "beta_s_per_byte"), float("nan"), "fits[1] (local, all, native).beta_s_per_byte "
                                                   "is nan"),
    (("fits", 2, "alpha_s"), float("inf"), "fits[2] (local, 4, ring).alpha_s is inf"),
    (("fits", 0, "alpha_s"), "fast", "fits[0] (local, all, all).alpha_s is 'fast'"),
    (("fits", 0, "gamma_s_per_byte"), True, "fits[0] (local, all, all).gamma_s_per_byte is True"),
    (("fits", 2, "world_size"), "4", "fits[2].world_size is '4'"),
    (("measured", 0, 4), 0, "measured[0] (local, 4, ring, 4096 B) seconds is 0"),
    (("measured", 1, 4), -1e-4, "measured[1] (local, 4, native, 4096 B) seconds is -0.0001"),
    (("measured", 0, 3), 4.5, "measured[0] bytes is 4.5"),
])
def test_a_tune_file_with_a_bad_number_is_refused_at_load_naming_file_and_field(
    tmp_path, where, value, field
):
    path, data = _tune_file(tmp_path)
    assert auto.load_tuning(path).choose("local", 4, 4096) == "ring"  # the good file, as written
    _set(data, where, value)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        auto.load_tuning(path)
    msg = str(e.value)
    assert (
        msg.startswith(f"{path}: {field}") and "run `dplab tune` again" in msg and "\n" not in msg
    )


def test_a_fit_that_prices_everything_at_zero_is_refused(tmp_path):
    path, data = _tune_file(tmp_path)
    for f in data["fits"]:
        f.update(alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)  # auto: naive everywhere
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"fits\[0\] .* are all 0, which prices every all-reduce "
                                          r"at 0 s"):
        auto.load_tuning(path)


def test_a_tune_file_that_is_not_text_or_not_a_file_is_one_line(tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"version": 1, "fits": [], "note": "\xe9"}')
    with pytest.raises(ConfigError, match="cannot read the tune file"):
        auto.load_tuning(bad)
    with pytest.raises(ConfigError, match="not a regular file"):
        auto.load_tuning(tmp_path)  # a directory (a FIFO would block)


def test_auto_with_a_bad_tune_file_is_one_line_before_any_rank_starts(
    tmp_path, monkeypatch, capsys
):
    path, data = _tune_file(tmp_path)
    data["fits"][0]["alpha_s"] = "fast"  # was a TypeError traceback from every rank
    path.write_text(json.dumps(data))
    monkeypatch.setenv(auto.TUNE_ENV, str(path))
    auto.reset()
    try:
        assert main(["train", *SMALL, "--algorithm", "auto"]) == 2
    finally:
        auto.reset()
    err = capsys.readouterr().err.strip()
    assert err.startswith("dplab train: error: ") and "alpha_s is 'fast'" in err and "\n" not in err


# -- 3. mixed precision: flags that mean nothing, scales that cannot work, runs that diverge -------

@pytest.mark.parametrize("flags, named", [
    (["--loss-scale", "1024"], "--loss-scale applies"),
    (["--reduce-dtype", "float16"], "--reduce-dtype applies"),
    (["--loss-scale", "dynamic", "--reduce-dtype", "float32", "--mixed-precision", "no"],
     "--loss-scale and --reduce-dtype apply"),
])
def test_precision_flags_without_mixed_precision_are_refused_at_parsing(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        f"error: {named} only to mixed precision: add --mixed-precision fp16" in err
        and "\n" not in err
    )


def test_precision_flags_count_in_any_order_with_mixed_precision():
    for argv in (["--loss-scale", "8", "--mixed-precision", "fp16"], ["--mixed-precision", "fp16",
                                                                     "--reduce-dtype", "float16"]):
        a = build_parser().parse_args(["train", *argv])
        assert a.mixed_precision == "fp16"
    a = build_parser().parse_args(["train"])
    assert (a.loss_scale, a.reduce_dtype) == (None, None)


@pytest.mark.parametrize("value", ["1e39", "1e-39"])
def test_a_loss_scale_outside_float32_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--mixed-precision", "fp16", "--loss-scale", value])
    assert "float32's range" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="float32's"):
        MixedPrecision(loss_scale=float(value)).validate()
    with pytest.raises(ConfigError, match="init_scale .*float32's"):
        MixedPrecision(init_scale=float(value)).validate()


def test_a_static_scale_that_overflows_stops_the_run_before_the_weights_take_the_inf(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rc = main(["train", *SMALL, "--mixed-precision", "fp16", "--loss-scale", "1e30"])
    assert rc == 2  # was rc 0 with a nan loss and replicas "not identical"; 2: a setting to change
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (
        "step 0: the gradients overflowed float16 (inf or nan) at the static loss scale 1e+30"
        in err
    )
    assert "'dynamic' to skip such steps" in err


def test_a_diverging_run_stops_with_an_error_not_a_nan_table(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rc = main(["train", *SMALL, "--lr", "1e300"])
    assert rc == 2  # the rank's ConfigError is one line, as a bad flag is
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "the parameters are inf or nan" in err


def test_dynamic_scaling_skips_overflows_and_stops_only_below_float32():
    scaler = LossScaler(MixedPrecision(init_scale=2.0**-124))
    assert [scaler.update(True, s) for s in range(2)] == [False, False]  # skipped, as GradScaler
    assert scaler.loss_scale == 2.0**-126  # float32's smallest normal: still in range
    assert scaler.update(False, 2) is True  # a good step steps
    with pytest.raises(ConfigError, match=r"step 3: the gradients held inf or nan at every loss "
                                          r"scale down "
                                          r"to 1.18e-38, .* lower the learning rate"):
        scaler.update(True, 3)
    with pytest.raises(ConfigError, match="checkpoint is damaged"):
        scaler.load_state_dict({"scale": float("nan"), "growth_tracker": 0})
    assert np.float32(scaler.loss_scale) > 0
