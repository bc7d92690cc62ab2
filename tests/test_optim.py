"""Optimizers on flat arrays: torch.optim's formulas, and state that round-trips exactly."""

from __future__ import annotations

import numpy as np
import pytest

from dplab.reference.errors import ConfigError
from dplab.reference.optim import Adam, Momentum, OptimConfig, make_optimizer

CONFIGS = [
    OptimConfig(name="sgd", lr=0.1),
    OptimConfig(name="sgd", lr=0.1, weight_decay=0.01),
    OptimConfig(name="momentum", lr=0.05, momentum=0.9),
    OptimConfig(name="momentum", lr=0.05, momentum=0.5, weight_decay=0.1),
    OptimConfig(name="adam", lr=0.01),
    OptimConfig(name="adam", lr=0.003, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
]


def torch_optimizer(cfg: OptimConfig, param):
    torch = pytest.importorskip("torch")
    if cfg.name == "adam":
        return torch.optim.Adam([param], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    momentum = cfg.momentum if cfg.name == "momentum" else 0.0
    return torch.optim.SGD([param], lr=cfg.lr, momentum=momentum, dampening=0,
                           nesterov=False, weight_decay=cfg.weight_decay)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-wd{c.weight_decay}")
def test_matches_torch_optim_step_for_step(cfg):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = rng.standard_normal(37)
    grads = rng.standard_normal((6, 37))
    t_param = torch.tensor(params.copy(), requires_grad=True)
    t_opt = torch_optimizer(cfg, t_param)
    opt = make_optimizer(cfg, num_params=37)
    for g in grads:
        t_param.grad = torch.tensor(g.copy())
        t_opt.step()
        opt.step(params, g)
        np.testing.assert_allclose(params, t_param.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert opt.t == 6


def test_first_steps_by_hand():
    params, grad = np.array([1.0, -2.0]), np.array([0.5, 1.0])
    opt = make_optimizer(OptimConfig(name="momentum", lr=0.1, momentum=0.5), 2)
    opt.step(params, grad)  # buf = g
    opt.step(params, grad)  # buf = 0.5 g + g
    np.testing.assert_allclose(params, [1.0 - 0.1 * (0.5 + 0.75), -2.0 - 0.1 * (1.0 + 1.5)])
    params = np.array([3.0])
    opt = make_optimizer(OptimConfig(name="adam", lr=0.01), 1)
    opt.step(params, np.array([-4.0]))  # first Adam step moves by ~lr * sign(g)
    assert params[0] == pytest.approx(3.01, abs=1e-8)
    assert isinstance(opt, Adam)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-wd{c.weight_decay}")
def test_state_dict_round_trip_continues_identically(cfg):
    rng = np.random.default_rng(1)
    params, grads = rng.standard_normal(11), rng.standard_normal((6, 11))
    opt = make_optimizer(cfg, 11)
    for g in grads[:3]:
        opt.step(params, g)
    state, saved = opt.state_dict(), params.copy()
    for g in grads[3:]:
        opt.step(params, g)
    assert opt.state_dict()["step"] == 6 and state["step"] == 3  # state_dict is a snapshot
    resumed = make_optimizer(cfg, 11)
    resumed.load_state_dict(state)
    for g in grads[3:]:
        resumed.step(saved, g)
    assert np.array_equal(saved, params)
    for key, value in opt.state_dict().items():
        assert np.array_equal(value, resumed.state_dict()[key])


def test_load_state_dict_copies_and_checks():
    opt = make_optimizer(OptimConfig(name="momentum"), 4)
    state = {"step": 2, "momentum_buffer": np.ones(4)}
    opt.load_state_dict(state)
    state["momentum_buffer"][:] = 9.0
    assert isinstance(opt, Momentum) and (opt.momentum_buffer == 1.0).all()
    with pytest.raises(ConfigError, match="keys"):
        opt.load_state_dict({"step": 1})
    with pytest.raises(ConfigError, match="shape"):
        opt.load_state_dict({"step": 1, "momentum_buffer": np.ones(5)})


def test_float32_state_and_shape_checks():
    opt = make_optimizer(OptimConfig(name="adam"), 3, dtype=np.float32)
    params = np.ones(3, dtype=np.float32)
    opt.step(params, np.ones(3, dtype=np.float32))
    assert params.dtype == opt.exp_avg.dtype == np.float32
    with pytest.raises(ConfigError, match="float32"):
        opt.step(np.ones(3), np.ones(3))
    with pytest.raises(ConfigError, match="shape"):
        opt.step(np.ones(4, dtype=np.float32), np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("kwargs", [
    {"name": "rmsprop"}, {"lr": -1.0}, {"momentum": 1.0}, {"betas": (0.9, 1.0)}, {"eps": 0.0},
    {"weight_decay": -0.1},
])
def test_bad_optimizer_config_raises(kwargs):
    with pytest.raises(ConfigError):
        OptimConfig(**kwargs)
