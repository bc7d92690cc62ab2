"""The lr scaling rules and the warm-up: values by hand, torch's LambdaLR, every trainer, resume."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dplab.backends.launch.world import launch
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.errors import ConfigError
from dplab.reference.lr import scaled_lr, warmup_lr
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig, evaluate, train_single
from dplab.reference.train.sync import SyncConfig, train_sync


def test_scaling_rules_by_hand():
    assert scaled_lr(0.1, 64, 4096, "linear") == pytest.approx(6.4)  # k = 64
    assert scaled_lr(0.1, 64, 4096, "sqrt") == pytest.approx(0.8)  # sqrt(64) = 8
    assert scaled_lr(0.1, 64, 4096, "none") == 0.1
    assert scaled_lr(0.1, 256, 64, "linear") == pytest.approx(0.025)  # smaller batches scale down
    assert scaled_lr(0.1, 256, 64, "sqrt") == pytest.approx(0.05)
    assert scaled_lr(0.3, 100, 100, "sqrt") == 0.3
    with pytest.raises(ConfigError, match="linear, sqrt, none"):
        scaled_lr(0.1, 64, 128, "cubic")
    for bad in ((0.1, 0, 64), (0.1, 64, 0), (math.nan, 64, 64), (-1.0, 64, 64)):
        with pytest.raises(ConfigError):
            scaled_lr(*bad)


def test_warmup_by_hand_and_config_checks():
    assert [warmup_lr(0.8, 4, t) for t in range(1, 7)] == [
        0.2,
        0.4,
        0.6000000000000001,
        0.8,
        0.8,
        0.8,
    ]
    assert warmup_lr(0.8, 0, 1) == 0.8 and warmup_lr(0.8, 1, 1) == 0.8
    for bad in ({"warmup_steps": -1}, {"warmup_steps": 2.5}, {"warmup_steps": True},
                {"trust_coef": 0.0}, {"trust_coef": math.inf}, {"name": "adagrad"}):
        with pytest.raises(ConfigError):
            OptimConfig(**bad)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_warmup_matches_torch_lambda_lr(name):
    """torch's LambdaLR multiplies lr by f(epoch) after each scheduler.step():
    f(e) = min(1, (e+1)/W) is our lr of update e + 1."""
    torch = pytest.importorskip("torch")
    cfg = OptimConfig(name, lr=0.05, warmup_steps=4, weight_decay=0.01)
    rng = np.random.default_rng(3)
    params, grads = rng.standard_normal(9), rng.standard_normal((7, 9))
    t_param = torch.tensor(params.copy(), requires_grad=True)
    if name == "adam":
        t_opt = torch.optim.Adam([t_param], lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        t_opt = torch.optim.SGD(
            [t_param],
            lr=cfg.lr,
            momentum=cfg.momentum if name == "momentum" else 0,
            weight_decay=cfg.weight_decay,
        )
    sched = torch.optim.lr_scheduler.LambdaLR(t_opt, lambda e: min(1.0, (e + 1) / 4))
    opt = make_optimizer(cfg, 9)
    for g in grads:
        t_param.grad = torch.tensor(g.copy())
        t_opt.step()
        sched.step()
        opt.step(params, g)
        np.testing.assert_allclose(params, t_param.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_warmup_zero_keeps_the_bits():
    a, b = OptimConfig("adam", lr=0.01), OptimConfig("adam", lr=0.01, warmup_steps=0)
    cfg = TrainConfig(steps=5)
    assert np.array_equal(train_single(dataclasses.replace(cfg, optimizer=a)).params,
                          train_single(dataclasses.replace(cfg, optimizer=b)).params)
    warm = train_single(
        dataclasses.replace(cfg, optimizer=OptimConfig("adam", lr=0.01, warmup_steps=3))
    )
    assert not np.array_equal(warm.params, train_single(cfg).params)


CLASSIFY = TrainConfig(MLPConfig(8, (16,), 3, loss="xent"), "classification", 128, 32, 12, seed=2)
LAYERWISE = [OptimConfig("lars", lr=3.0, trust_coef=0.01, weight_decay=1e-4, warmup_steps=4),
             OptimConfig("lamb", lr=0.02, weight_decay=0.01, warmup_steps=4)]


@pytest.mark.parametrize("opt", LAYERWISE, ids=lambda o: o.name)
def test_layerwise_in_sync_and_parameter_server_equal_the_single_device_run(opt):
    cfg = dataclasses.replace(CLASSIFY, optimizer=opt)
    single = train_single(cfg)
    assert evaluate(cfg, single.params) < 0.9 * single.losses[0]  # it learns
    for r in launch(train_sync, 2, args=(cfg, SyncConfig("ring"))):
        np.testing.assert_allclose(r.params, single.params, rtol=1e-10, atol=1e-12)
    acfg = AsyncConfig(staleness=0)
    server = launch(train_async, 3, args=(cfg, acfg))[0]  # the server steps per worker gradient
    assert np.array_equal(replay(cfg, acfg, server.log, 2), server.params)


@pytest.mark.parametrize("opt", LAYERWISE, ids=lambda o: o.name)
def test_resume_inside_the_warmup_is_exact(tmp_path, opt):
    """The lr comes from the optimizer's step count, which the checkpoint holds: resuming at
    step 3 of a 4-step warm-up continues the ramp, bit for bit."""
    cfg = dataclasses.replace(CLASSIFY, steps=7, optimizer=opt)
    whole = launch(
        train_sync, 2, args=(cfg, SyncConfig(checkpoint=CheckpointConfig(3, str(tmp_path))))
    )
    again = CheckpointConfig(resume=str(tmp_path / "ckpt-00000003.npz"))
    resumed = launch(train_sync, 2, args=(cfg, SyncConfig(checkpoint=again)))
    assert np.array_equal(resumed[0].params, whole[0].params)
    other = dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, warmup_steps=5))
    with pytest.raises(Exception, match=r"warmup_steps"):  # a different ramp is another run
        launch(train_sync, 2, args=(other, SyncConfig(checkpoint=again)))
