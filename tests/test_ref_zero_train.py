"""ZeRO stages 0-3 == single-device training, on every backend, for any shard and batch split.

Whatever the stage, world size (1-4), model shape (layers smaller than the world included:
empty chunks), global batch (smaller than the world: empty shards), optimizer, weight decay,
warm-up and number of micro-batches, ``train_zero`` must land on ``train_single``'s parameters
within 1e-10 relative in float64, with every rank holding bitwise the same parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import train_configs
from tiers import engine_spans

from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.layers import layer_delta, layer_forward, layer_grads, output_delta
from dplab.reference.zero.train import train_zero

EXAMPLES = settings.default.max_examples  # DPLAB_EXAMPLES, default 50


def rel(a, b) -> float:
    """max|a - b| / max(1, max|b|), as in test_sync."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return 0.0 if a.size == 0 else float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _train(comm, cfg, zero):
    return train_zero(comm, cfg, zero)


def check_equals_single(results, cfg: TrainConfig, tol: float) -> None:
    ref = train_single(cfg)
    first = results[0]
    assert first.params.dtype == np.dtype(cfg.dtype) and len(first.losses) == cfg.steps
    err = rel(first.params, ref.params)
    assert err <= tol, f"params differ from train_single by {err:.3g} (relative)"
    assert rel(first.losses, ref.losses) <= tol, f"losses {first.losses} vs single {ref.losses}"
    for rank, r in enumerate(results):
        assert np.array_equal(r.params, first.params), f"rank {rank} params differ from rank 0's"
        assert r.losses == first.losses, f"rank {rank} logged other losses than rank 0"
    assert sum(r.shard_elems for r in results) == ref.params.size  # the chunks tile the model


@st.composite
def zero_configs(draw) -> ZeroConfig:
    stage = draw(st.integers(0, 3))
    algorithms = ["ring", "direct", "naive", "tree", "native"] if stage == 0 else ["ring", "direct"]
    return ZeroConfig(stage=stage, algorithm=draw(st.sampled_from(algorithms)),
                      accum_steps=draw(st.integers(1, 4)), prefetch=draw(st.booleans()))


@st.composite
def zero_train_configs(draw, dtype: str = "float64") -> TrainConfig:
    cfg = draw(train_configs(dtype))
    opt = dataclasses.replace(cfg.optimizer, weight_decay=draw(st.sampled_from([0.0, 0.01])),
                              warmup_steps=draw(st.integers(0, 2)))
    return dataclasses.replace(cfg, optimizer=opt)


# local: p in 1..4, every example; other engines: p = 3, a quarter (all: slow)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 4), indirect=["backend"])
@pytest.mark.parametrize("dtype, tol, factor", [("float64", 1e-10, 4), ("float32", 1e-5, 2)])
def test_train_zero_equals_train_single(worlds, backend, sweep, dtype, tol, factor):
    @settings(max_examples=sweep.examples(factor * EXAMPLES), deadline=None)
    @given(p=st.integers(sweep.lo, sweep.hi), cfg=zero_train_configs(dtype), zero=zero_configs())
    def prop(p, cfg, zero):
        results = worlds(p, backend).run(_train, cfg, zero)
        assert len(results) == p
        check_equals_single(results, cfg, tol)

    prop()


BASE = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                   global_batch=11, steps=3, seed=3, optimizer=OptimConfig("adam", lr=0.01))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("p, global_batch, accum_steps, dims", [
    (4, 3, 1, (5, 7, 3)),     # a rank with an empty shard every step
    # empty micro-batches; layer 0 has 1*1+1 = 2 < p elements: empty chunks
    (4, 2, 3, (1, 1, 3)),
    (3, 100, 2, (5, 7, 3)),   # batch larger than the data set: indices repeat
])
def test_empty_shards_chunks_and_micro_batches_still_match(worlds, backend, stage, p, global_batch,
                                                          accum_steps, dims):
    model = MLPConfig(in_dim=dims[0], hidden=dims[1:-1], out_dim=dims[-1])
    cfg = dataclasses.replace(BASE, global_batch=global_batch, model=model)
    zero = ZeroConfig(
        stage=stage, algorithm="direct" if stage == 2 else "ring", accum_steps=accum_steps
    )
    check_equals_single(worlds(p, backend).run(_train, cfg, zero), cfg, 1e-10)


def test_training_moves_the_parameters_and_stage3_without_prefetch_matches(worlds):
    """Guard against a vacuous pass, and prefetch changes when things happen, not what."""
    cfg = dataclasses.replace(BASE, steps=4)
    on = worlds(3).run(_train, cfg, ZeroConfig(stage=3, prefetch=True))
    off = worlds(3).run(_train, cfg, ZeroConfig(stage=3, prefetch=False))
    assert rel(on[0].params, setup(cfg)[2]) > 1e-3
    assert np.array_equal(on[0].params, off[0].params)  # the same sums in the same order: same bits
    check_equals_single(on, cfg, 1e-10)


@pytest.mark.parametrize("stage", [0, 3])
def test_steps_zero_returns_rank0_initial_params(worlds, stage):
    cfg = dataclasses.replace(BASE, steps=0)
    initial = setup(cfg)[2]
    for r in worlds(3).run(_train, cfg, ZeroConfig(stage=stage)):
        assert r.losses == [] and np.array_equal(r.params, initial)


# -- the layer-at-a-time MLP is the MLP ---------------------------------------------------------

@pytest.mark.parametrize("loss, activation", [("mse", "tanh"), ("xent", "relu")])
def test_layerwise_forward_backward_are_bitwise_the_model(loss, activation):
    mcfg = MLPConfig(in_dim=4, hidden=(6, 5), out_dim=3, activation=activation, loss=loss)
    model, rng = MLP(mcfg), np.random.default_rng(0)
    params = model.init_params(1)
    x = rng.standard_normal((7, 4))
    y = rng.integers(0, 3, 7) if loss == "xent" else rng.standard_normal((7, 3))
    acts_ref = model.forward(params, x)
    grad_ref = np.zeros_like(params)
    for _ in model.backward(params, acts_ref, y, grad_ref, 1 / 9):
        pass
    acts, grad = [x], np.zeros_like(params)
    for layer in range(model.num_layers):
        acts.append(layer_forward(model, layer, params[model.layer_slice(layer)], acts[-1]))
    delta = output_delta(model, acts[-1], y, 1 / 9)
    for layer in reversed(range(model.num_layers)):
        w, g = params[model.layer_slice(layer)], grad[model.layer_slice(layer)]
        layer_grads(model, layer, acts[layer], delta, g)
        if layer:
            delta = layer_delta(model, layer, w, acts[layer], delta)
    for a, b in zip(acts, acts_ref, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(grad, grad_ref)


# -- configuration errors say what to do -----------------------------------------------------------

@pytest.mark.parametrize("zero, words", [
    (ZeroConfig(stage=4), "0, 1, 2 or 3"),
    (ZeroConfig(stage=True), "0, 1, 2 or 3"),
    (ZeroConfig(stage=2, algorithm="tree"), "choose one of ring, direct"),
    (ZeroConfig(stage=1, algorithm="native"), "choose one of ring, direct"),
    (ZeroConfig(stage=0, algorithm="bogus"), "choose one of naive"),
    (ZeroConfig(accum_steps=0), "accum_steps must be an integer >= 1"),
    (ZeroConfig(prefetch="yes"), "prefetch must be True or False"),
])
def test_bad_configs_are_refused_with_the_fix(zero, words):
    with pytest.raises(ConfigError, match=words):
        zero.validate(2)


@pytest.mark.parametrize("name, lr", [("lars", 2.0), ("lamb", 0.01)])
def test_layerwise_optimizers_take_whole_tensor_norms_from_the_chunks(worlds, backend, name, lr):
    """LARS and LAMB scale each tensor by its whole norm; under stages 1-3 the chunks' squared norms
    are all-reduced (``zero/layerwise.py``), so every stage still equals one device. p = 3 cuts the
    layers' [W, b] ranges inside W and across W|b, and the 2-unit bias leaves one rank nothing."""
    opt = OptimConfig(name, lr=lr, weight_decay=0.01, warmup_steps=1)
    cfg = dataclasses.replace(BASE, optimizer=opt, steps=3)
    for stage in (0, 1, 2, 3):
        for p in ((1, 2, 3) if backend == "local" else (3,)):
            check_equals_single(
                worlds(p, backend).run(_train, cfg, ZeroConfig(stage=stage)), cfg, 1e-10
            )
