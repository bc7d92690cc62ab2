"""The single-device trainer: it learns, it is bitwise reproducible, it rejects bad configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.train.single import TrainConfig, evaluate, setup, train_single

REGRESSION = TrainConfig(steps=50)
CLASSIFICATION = TrainConfig(steps=50, dataset="classification", model=MLPConfig(loss="xent"))


@pytest.mark.parametrize("cfg", [
    REGRESSION,
    CLASSIFICATION,
    dataclasses.replace(REGRESSION, optimizer=OptimConfig(name="adam", lr=0.01)),
    dataclasses.replace(CLASSIFICATION, optimizer=OptimConfig(name="momentum", lr=0.05)),
], ids=["regression-sgd", "classification-sgd", "regression-adam", "classification-momentum"])
def test_loss_goes_down(cfg):
    result = train_single(cfg)
    assert len(result.losses) == cfg.steps and all(np.isfinite(result.losses))
    assert np.mean(result.losses[-5:]) < 0.6 * np.mean(result.losses[:5])
    _, _, initial = setup(cfg)
    assert evaluate(cfg, result.params) < 0.6 * evaluate(cfg, initial)


def test_train_single_is_bitwise_deterministic_and_seed_dependent():
    a, b = train_single(REGRESSION), train_single(REGRESSION)
    assert np.array_equal(a.params, b.params) and a.losses == b.losses
    c = train_single(dataclasses.replace(REGRESSION, seed=1))
    assert not np.array_equal(a.params, c.params)


def test_first_loss_is_the_mean_loss_of_the_first_global_batch():
    cfg = dataclasses.replace(CLASSIFICATION, steps=1, global_batch=7)
    model, data, params = setup(cfg)
    idx = batch_indices(cfg.num_samples, 7, 0, cfg.seed)
    per_sample = [model.loss(model.forward(params, data.x[[i]]), data.y[[i]], 1.0) for i in idx]
    assert train_single(cfg).losses[0] == pytest.approx(np.mean(per_sample), rel=1e-12)


@pytest.mark.parametrize("world_size", [1, 3, 5, 40])
def test_summing_shard_gradients_reproduces_train_single(world_size):
    """A data-parallel run in miniature: shard every global batch, sum the ranks' gradients.

    The global batch (30) is not divisible by 4 or 7 and is smaller than 40, so some ranks
    get one sample more and some get none; the parameters still match the oracle.
    """
    cfg = TrainConfig(steps=8, global_batch=30, num_samples=50,
                      optimizer=OptimConfig(name="adam", lr=0.01))
    model, data, params = setup(cfg)
    opt = make_optimizer(cfg.optimizer, model.num_params)
    for step in range(cfg.steps):
        idx = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        total = np.zeros(model.num_params)
        for rank in range(world_size):
            mine = shard(idx, rank, world_size)
            total += model.loss_and_grad(params, data.x[mine], data.y[mine], 1 / 30)[1]
        opt.step(params, total)
    np.testing.assert_allclose(params, train_single(cfg).params, rtol=1e-10, atol=1e-12)


def test_float32_run_tracks_float64_run():
    r64 = train_single(dataclasses.replace(REGRESSION, steps=10))
    r32 = train_single(dataclasses.replace(REGRESSION, steps=10, dtype="float32"))
    assert r32.params.dtype == np.float32
    np.testing.assert_allclose(r32.params, r64.params, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(r32.losses, r64.losses, rtol=1e-4)


def test_zero_steps_returns_the_initial_parameters():
    result = train_single(dataclasses.replace(REGRESSION, steps=0))
    assert result.losses == [] and np.array_equal(result.params, setup(REGRESSION)[2])


@pytest.mark.parametrize("changes, match", [
    ({"dataset": "classification"}, "model.loss='xent'"),
    ({"model": MLPConfig(loss="xent")}, "model.loss='mse'"),
    ({"dataset": "images"}, "dataset"),
    ({"dataset": "classification", "model": MLPConfig(loss="xent", out_dim=1)}, "out_dim"),
    ({"global_batch": 0}, "global_batch"),
    ({"num_samples": 0}, "num_samples"),
    ({"steps": -1}, "steps"),
    ({"seed": -3}, "seed"),
    ({"dtype": "float16"}, "dtype"),
])
def test_bad_configs_raise_config_error_naming_the_field(changes, match):
    cfg = dataclasses.replace(TrainConfig(), **changes)  # constructing is fine ...
    with pytest.raises(ConfigError, match=match) as info:
        cfg.validate()  # ... validating says what to change
    assert isinstance(info.value, DplabError) and isinstance(info.value, ValueError)
    with pytest.raises(ConfigError):
        train_single(cfg)
