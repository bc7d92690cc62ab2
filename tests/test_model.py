"""The NumPy MLP: gradients are right, come out layer by layer, and add up across shards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig

configs = st.builds(
    MLPConfig,
    in_dim=st.integers(1, 4),
    hidden=st.lists(st.integers(1, 4), max_size=2).map(tuple),
    out_dim=st.integers(1, 3),
    activation=st.sampled_from(["tanh", "relu"]),
    loss=st.sampled_from(["mse", "xent"]),
)


def make_batch(cfg: MLPConfig, batch: int, seed: int, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, cfg.in_dim)).astype(dtype)
    if cfg.loss == "mse":
        return x, rng.standard_normal((batch, cfg.out_dim)).astype(dtype)
    return x, rng.integers(0, cfg.out_dim, size=batch)


def random_params(model: MLP, seed: int) -> np.ndarray:
    """Random biases too (init zeroes them), so the bias gradients are exercised in general."""
    return np.random.default_rng(seed + 1).standard_normal(model.num_params)


def preactivations(model: MLP, params: np.ndarray, acts: list[np.ndarray]) -> list[np.ndarray]:
    p = model.views(params)
    return [acts[k] @ p[2 * k] + p[2 * k + 1] for k in range(model.num_layers - 1)]


@settings(max_examples=60, deadline=None)
@given(cfg=configs, batch=st.integers(0, 5), seed=st.integers(0, 2**16), scale=st.floats(0.1, 2))
def test_gradient_matches_central_differences(cfg, batch, seed, scale):
    model = MLP(cfg)
    params = random_params(model, seed)
    x, y = make_batch(cfg, batch, seed)
    if cfg.activation == "relu":  # finite differences are wrong right at the kink
        zs = preactivations(model, params, model.forward(params, x))
        assume(all(z.size == 0 or np.abs(z).min() > 1e-4 for z in zs))
    _, grad = model.loss_and_grad(params, x, y, scale)
    h, numeric = 1e-6, np.empty_like(params)
    for i in range(model.num_params):
        plus, minus = params.copy(), params.copy()
        plus[i] += h
        minus[i] -= h
        f = [model.loss(model.forward(p, x), y, scale) for p in (plus, minus)]
        numeric[i] = (f[0] - f[1]) / (2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)
    if batch == 0:
        assert not grad.any()


@pytest.mark.parametrize("loss", ["mse", "xent"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_loss_and_grad_match_torch_autograd(activation, loss):
    """An independent oracle: the same network written in torch, differentiated by autograd."""
    torch = pytest.importorskip("torch")
    cfg = MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3, activation=activation, loss=loss)
    model = MLP(cfg)
    params = random_params(model, 0)
    x, y = make_batch(cfg, 9, seed=1)
    loss_np, grad_np = model.loss_and_grad(params, x, y, scale=1 / 9)
    ts = [torch.tensor(v.copy(), requires_grad=True) for v in model.views(params)]
    h = torch.tensor(x)
    for layer in range(model.num_layers):
        h = h @ ts[2 * layer] + ts[2 * layer + 1]
        if layer < model.num_layers - 1:
            h = torch.tanh(h) if activation == "tanh" else torch.relu(h)
    if loss == "mse":
        out = 0.5 * ((h - torch.tensor(y)) ** 2).sum() / 9
    else:
        out = torch.nn.functional.cross_entropy(h, torch.tensor(y), reduction="mean")
    out.backward()
    assert loss_np == pytest.approx(out.item(), rel=1e-12)
    np.testing.assert_allclose(grad_np, np.concatenate([t.grad.ravel().numpy() for t in ts]),
                               rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("hidden", [(), (4,), (4, 5, 3)])
def test_backward_yields_last_layer_first_and_writes_only_finished_layers(hidden):
    """After yielding l, layers >= l hold their final gradient and layers < l are untouched.

    That is the contract a bucketed all-reduce relies on to start sending early.
    """
    model = MLP(MLPConfig(in_dim=3, hidden=hidden, out_dim=2))
    params = random_params(model, 3)
    x, y = make_batch(model.cfg, 6, seed=4)
    _, full = model.loss_and_grad(params, x, y, scale=0.25)
    sentinel = 7.0
    grad = np.full(model.num_params, sentinel)
    gen = model.backward(params, model.forward(params, x), y, grad, scale=0.25)
    order = []
    for layer in gen:
        order.append(layer)
        for k in range(model.num_layers):
            sl = model.layer_slice(k)
            if k >= layer:
                np.testing.assert_allclose(grad[sl], sentinel + full[sl], rtol=0, atol=1e-15)
            else:
                assert (grad[sl] == sentinel).all()
    assert order == list(reversed(range(model.num_layers)))


def test_layout_is_contiguous_layer_order_and_views_alias_the_flat_vector():
    model = MLP(MLPConfig(in_dim=3, hidden=(4, 5), out_dim=2))
    assert model.num_layers == 3
    assert model.param_names == ["W0", "b0", "W1", "b1", "W2", "b2"]
    assert model.param_shapes == [(3, 4), (4,), (4, 5), (5,), (5, 2), (2,)]
    assert model.num_params == 12 + 4 + 20 + 5 + 10 + 2
    assert [model.layer_slice(k) for k in range(3)] == [slice(0, 16), slice(16, 41), slice(41, 53)]
    flat = np.zeros(model.num_params)
    views = model.views(flat)
    views[2][1, 2] = 5.0
    assert flat[16 + 1 * 5 + 2] == 5.0
    assert all(np.shares_memory(v, flat) for v in views)
    with pytest.raises(ConfigError):
        model.layer_slice(3)


def test_init_is_deterministic_and_scaled_by_activation():
    model = MLP(MLPConfig(in_dim=64, hidden=(64,), out_dim=64, activation="relu"))
    a, b = model.init_params(5), model.init_params(5)
    assert np.array_equal(a, b) and not np.array_equal(a, model.init_params(6))
    w0 = model.views(a)[0]
    assert w0.std() == pytest.approx(np.sqrt(2 / 64), rel=0.05)  # He
    assert not model.views(a)[1].any()  # zero biases
    tanh = MLP(MLPConfig(in_dim=64, hidden=(64,), out_dim=64))
    assert tanh.views(tanh.init_params(5))[0].std() == pytest.approx(np.sqrt(1 / 64), rel=0.05)
    f32 = model.init_params(5, dtype=np.float32)
    assert f32.dtype == np.float32 and np.array_equal(f32, a.astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(cfg=configs, seed=st.integers(0, 2**16), b1=st.integers(0, 4), b2=st.integers(0, 4))
def test_backward_accumulates_across_calls(cfg, seed, b1, b2):
    model = MLP(cfg)
    params = random_params(model, seed)
    (x1, y1), (x2, y2) = make_batch(cfg, b1, seed), make_batch(cfg, b2, seed + 7)
    _, g1 = model.loss_and_grad(params, x1, y1, 0.5)
    _, g2 = model.loss_and_grad(params, x2, y2, 0.5)
    grad = np.zeros(model.num_params)
    model.loss_and_grad(params, x1, y1, 0.5, grad)
    out = model.loss_and_grad(params, x2, y2, 0.5, grad)[1]
    assert out is grad
    np.testing.assert_allclose(grad, g1 + g2, rtol=1e-12, atol=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    cfg=configs,
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 12),
    cuts=st.lists(st.floats(0, 1), max_size=6),
)
def test_shard_gradients_sum_to_full_batch_gradient(cfg, seed, batch, cuts):
    """The heart of data parallelism.

    Split a global batch of B samples into shards of ANY sizes (uneven, empty, all on one
    rank). If every shard computes its loss as ``(1/B) * sum over its own samples``, the
    shards' losses and gradients SUM to the full batch's mean loss and gradient, because
    the loss is a sum over samples and differentiation is linear. So an all-reduce SUM of
    the ranks' gradients is exactly the single-device gradient: no re-weighting by shard
    size, and no special case for ranks whose shard is empty.
    """
    model = MLP(cfg)
    params = random_params(model, seed)
    x, y = make_batch(cfg, batch, seed)
    scale = 1 / max(batch, 1)
    full_loss, full_grad = model.loss_and_grad(params, x, y, scale)
    bounds = [0, *sorted(round(c * batch) for c in cuts), batch]
    loss_sum, grad_sum = 0.0, np.zeros(model.num_params)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        loss, grad = model.loss_and_grad(params, x[lo:hi], y[lo:hi], scale)
        loss_sum += loss
        grad_sum += grad
    assert loss_sum == pytest.approx(full_loss, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(grad_sum, full_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss", ["mse", "xent"])
def test_float32_stays_float32_and_agrees_with_float64(loss):
    model = MLP(MLPConfig(in_dim=4, hidden=(8,), out_dim=3, loss=loss))
    p64 = model.init_params(0)
    x, y = make_batch(model.cfg, 16, seed=2)
    l64, g64 = model.loss_and_grad(p64, x, y, 1 / 16)
    p32 = p64.astype(np.float32)
    acts = model.forward(p32, x)  # float64 x is cast to the params' dtype
    assert all(a.dtype == np.float32 for a in acts)
    l32, g32 = model.loss_and_grad(p32, x, y, 1 / 16)
    assert g32.dtype == np.float32
    assert l32 == pytest.approx(l64, rel=1e-5)
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-6)


def test_xent_is_stable_for_huge_logits():
    model = MLP(MLPConfig(in_dim=1, hidden=(), out_dim=2, loss="xent"))
    params = np.array([1000.0, -1000.0, 0.0, 0.0])  # W0 = [[1000, -1000]], b0 = 0
    loss, grad = model.loss_and_grad(params, np.array([[1.0]]), np.array([1]), 1.0)
    assert loss == pytest.approx(2000.0) and np.isfinite(grad).all()


def test_bad_configs_and_inputs_raise_config_error():
    for kwargs in [{"in_dim": 0}, {"hidden": (3, 0)}, {"activation": "gelu"}, {"loss": "l1"}]:
        with pytest.raises(ConfigError):
            MLPConfig(**kwargs)
    assert MLPConfig(hidden=[3, 4]).hidden == (3, 4)
    model = MLP(MLPConfig(in_dim=2, hidden=(), out_dim=3, loss="xent"))
    params = model.init_params(0)
    with pytest.raises(ConfigError, match="shape"):
        model.forward(params, np.zeros((2, 5)))
    with pytest.raises(ConfigError, match="labels"):
        model.loss_and_grad(params, np.zeros((1, 2)), np.array([3]), 1.0)
    with pytest.raises(ConfigError, match="flat"):
        model.views(np.zeros(model.num_params + 1))
