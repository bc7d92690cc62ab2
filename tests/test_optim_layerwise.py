"""LARS and LAMB: hand computations, the papers' algorithms written independently, and the rules.

The hand computations are two steps on a "weight" [3, 4] (norm 5) and a zero "bias", numbers
written out line by line. The paper check runs each optimizer against a per-tensor transcription
of You et al.'s Algorithm 1 (LARS) / Algorithm 2 (LAMB), with its own state per tensor.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dplab.reference.errors import ConfigError
from dplab.reference.optim import LAMB, LARS, OptimConfig, check_layers, make_optimizer

LAYERS = [slice(0, 2), slice(2, 3)]  # weight (2 numbers), bias (1)


def test_lars_two_steps_by_hand():
    cfg = OptimConfig("lars", lr=0.5, momentum=0.9, weight_decay=0.1, trust_coef=0.1)
    params = np.array([3.0, 4.0, 0.0])
    opt = make_optimizer(cfg, 3, layers=LAYERS)
    assert isinstance(opt, LARS)
    opt.step(params, np.array([0.6, 0.8, 2.0]))
    # weight: ||w|| = 5, ||g|| = 1: local_lr = 0.1 * 5 / (1 + 0.1 * 5) = 1/3
    #   v = 0.5 * 1/3 * (g + 0.1 w) = (1/6) * [0.9, 1.2] = [0.15, 0.2];  w = [2.85, 3.8]
    # bias: ||b|| = 0, so ratio 1: v = 0.5 * (2 + 0) = 1;  b = -1
    np.testing.assert_allclose(params, [2.85, 3.8, -1.0], rtol=1e-14)
    opt.step(params, np.array([0.0, 0.5, 0.0]))
    # weight: ||w|| = 0.95 * 5 = 4.75, ||g|| = 0.5: local_lr = 0.475 / (0.5 + 0.475) = 19/39
    #   g + 0.1 w = [0.285, 0.88];  v = 0.9 [0.15, 0.2] + 0.5 * 19/39 * [0.285, 0.88]
    v = np.array([0.135 + 19 / 78 * 0.285, 0.18 + 19 / 78 * 0.88])
    # bias: ||g|| = 0, so ratio 1: v = 0.9 * 1 + 0.5 * (0 + 0.1 * -1) = 0.85;  b = -1.85
    np.testing.assert_allclose(params, [2.85 - v[0], 3.8 - v[1], -1.85], rtol=1e-14)
    np.testing.assert_allclose(params[:2], [2.645576923076923, 3.405641025641026], rtol=1e-14)
    np.testing.assert_allclose(opt.momentum_buffer, [*v, 0.85], rtol=1e-14)


def test_lamb_two_steps_by_hand():
    eps, wd, lr = 1e-8, 0.01, 0.1
    cfg = OptimConfig("lamb", lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=wd)
    params = np.array([3.0, 4.0, 0.0])
    opt = make_optimizer(cfg, 3, layers=LAYERS)
    assert isinstance(opt, LAMB)
    g1 = np.array([0.6, 0.8, 2.0])
    opt.step(params, g1)
    # t = 1: m_hat = g, v_hat = g^2, so r = g / (|g| + eps), about [1, 1, 1]
    r = g1 / (np.abs(g1) + eps)
    u_w = r[:2] + wd * np.array([3.0, 4.0])  # [1.03, 1.04]
    assert np.linalg.norm(u_w) == pytest.approx(math.sqrt(1.03**2 + 1.04**2), rel=1e-7)
    w1 = np.array([3.0, 4.0]) - lr * 5 / np.linalg.norm(u_w) * u_w  # ratio ||w||/||u|| = 5/1.463728
    b1 = 0.0 - lr * 1.0 * r[2]  # zero bias: ratio 1, u = r + wd * 0
    np.testing.assert_allclose(params, [*w1, b1], rtol=1e-14)
    np.testing.assert_allclose(params, [2.648159, 3.644743, -0.1], rtol=1e-6)
    g2 = np.array([0.3, -0.4, 1.0])
    opt.step(params, g2)
    # t = 2: m = 0.9 * 0.1 g1 + 0.1 g2 = [0.084, 0.032, 0.28];  m_hat = m / (1 - 0.9^2) = m / 0.19
    m = np.array([0.084, 0.032, 0.28])
    # v = 0.999 * 0.001 g1^2 + 0.001 g2^2 = [0.00044964, 0.00079936, 0.004996];
    # v_hat = v / 0.001999
    v = np.array([0.00044964, 0.00079936, 0.004996])
    np.testing.assert_allclose(opt.exp_avg, m, rtol=1e-14)
    np.testing.assert_allclose(opt.exp_avg_sq, v, rtol=1e-12)
    r = (m / 0.19) / (np.sqrt(v / 0.001999) + eps)
    u = r + wd * np.array([*w1, b1])
    w2 = w1 - lr * np.linalg.norm(w1) / np.linalg.norm(u[:2]) * u[:2]
    b2 = b1 - lr * abs(b1) / abs(u[2]) * u[2]  # the bias is no longer 0: its own trust ratio
    np.testing.assert_allclose(params, [*w2, b2], rtol=1e-13)


def lars_paper(cfg, tensors, grads_per_step):
    """Algorithm 1 of You, Gitman, Ginsburg (2017), per tensor, MLPerf's zero-norm convention."""
    out = []
    for w in tensors:
        w, v = w.copy(), np.zeros_like(w)
        out.append([w, v])
    for t, grads in enumerate(grads_per_step, start=1):
        gamma = cfg.lr * min(1.0, t / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for state, g in zip(out, grads):
            w, v = state
            wn, gn = math.sqrt(sum(x * x for x in w)), math.sqrt(sum(x * x for x in g))
            lam = cfg.trust_coef * wn / (gn + cfg.weight_decay * wn) if wn > 0 and gn > 0 else 1.0
            state[1] = cfg.momentum * v + gamma * lam * (g + cfg.weight_decay * w)
            state[0] = w - state[1]
    return np.concatenate([s[0] for s in out])


def lamb_paper(cfg, tensors, grads_per_step):
    """Algorithm 2 of You et al. (2019), per tensor, phi = identity, ratio 1 at zero norms."""
    (b1, b2), out = cfg.betas, [[w.copy(), np.zeros_like(w), np.zeros_like(w)] for w in tensors]
    for t, grads in enumerate(grads_per_step, start=1):
        eta = cfg.lr * min(1.0, t / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for state, g in zip(out, grads):
            x, m, v = state
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + cfg.eps)
            u = r + cfg.weight_decay * x
            xn, un = np.linalg.norm(x), np.linalg.norm(u)
            ratio = xn / un if xn > 0 and un > 0 else 1.0
            state[:] = [x - eta * ratio * u, m, v]
    return np.concatenate([s[0] for s in out])


@pytest.mark.parametrize("cfg", [
    OptimConfig("lars", lr=2.0, momentum=0.9, trust_coef=0.02),
    OptimConfig("lars", lr=5.0, momentum=0.5, weight_decay=0.05, trust_coef=0.001, warmup_steps=3),
    OptimConfig("lamb", lr=0.05),
    OptimConfig("lamb", lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=4),
], ids=lambda c: f"{c.name}-wd{c.weight_decay}-warm{c.warmup_steps}")
def test_matches_the_papers_algorithm_per_tensor(cfg):
    rng = np.random.default_rng(7)
    sizes = [12, 4, 8, 3, 1]  # tensors of an MLP: W0 b0 W1 b1 ... (b0 starts at zero)
    tensors = [rng.standard_normal(n) for n in sizes]
    tensors[1][:] = 0.0
    steps = [[rng.standard_normal(n) for n in sizes] for _ in range(7)]
    steps[2][3][:] = 0.0  # a zero gradient: ratio 1 for LARS
    bounds = np.cumsum([0, *sizes])
    layers = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    params = np.concatenate(tensors)
    opt = make_optimizer(cfg, len(params), layers=layers)
    for grads in steps:
        opt.step(params, np.concatenate(grads))
    want = (lars_paper if cfg.name == "lars" else lamb_paper)(cfg, tensors, steps)
    np.testing.assert_allclose(params, want, rtol=1e-12, atol=1e-14)
    assert opt.t == 7


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_needs_layers_and_says_how(name):
    with pytest.raises(ConfigError, match="needs layers=.*param_slices"):
        make_optimizer(OptimConfig(name), 5)
    for bad in ([slice(0, 2), slice(3, 5)], [slice(0, 2)], [slice(0, 5, 2)], [slice(1, 5)]):
        with pytest.raises(ConfigError, match="param_slices"):
            make_optimizer(OptimConfig(name), 5, layers=bad)
    assert check_layers([slice(0, 2), slice(2, 5)], 5, name) == (slice(0, 2), slice(2, 5))
    make_optimizer(OptimConfig("adam"), 5)  # the others keep working without


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_state_round_trip_continues_identically(name):
    cfg = OptimConfig(name, lr=0.5 if name == "lars" else 0.01, weight_decay=0.01, warmup_steps=4)
    rng = np.random.default_rng(1)
    params, grads = rng.standard_normal(11), rng.standard_normal((6, 11))
    layers = [slice(0, 6), slice(6, 8), slice(8, 11)]
    opt = make_optimizer(cfg, 11, layers=layers)
    for g in grads[:3]:
        opt.step(params, g)
    state, saved = opt.state_dict(), params.copy()
    for g in grads[3:]:
        opt.step(params, g)
    resumed = make_optimizer(cfg, 11, layers=layers)
    resumed.load_state_dict(state)  # the warm-up position comes back with the step count
    for g in grads[3:]:
        resumed.step(saved, g)
    assert np.array_equal(saved, params)


def test_float32_stays_float32():
    params = np.array([3.0, 4.0, 0.0], dtype=np.float32)
    for name in ("lars", "lamb"):
        p = params.copy()
        opt = make_optimizer(OptimConfig(name, lr=0.1, weight_decay=0.01), 3, np.float32, LAYERS)
        opt.step(p, np.array([0.6, 0.8, 2.0], dtype=np.float32))
        assert p.dtype == np.float32 and all(
            getattr(opt, n).dtype == np.float32 for n in opt._state_names
        )
        assert np.isfinite(p).all() and not np.array_equal(p, params)
