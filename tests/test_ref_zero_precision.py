"""ZeRO in mixed precision: float16 compute copies, float32 masters, loss scaling, every stage.

Accuracy: against the float64 single-device oracle, within the bound ``test_precision_train``
holds ``train_sync`` to (relative 1e-4; float16 compute puts it above float32's ~1e-7).
Memory, measured per rank: the paper's forms with P = 2 (float16 weights), G = the reduction's
bytes (2 in float16, 4 in float32), K = 4 (float32 master) + 4 per moment, exactly, plus the
stated allowances: the in-flight layers of ``test_ref_zero_memory`` (in their dtypes) and, in
the optimizer phase, one float32 buffer of the largest layer part this rank updates (the
unscaled gradient of one layer at a time, ``zero/amp.py``).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
from test_ref_zero_memory import (
    _traced_against_ledger,
    grads_in_flight,
    layer_sizes,
    params_in_flight,
)

from dplab.backends.launch.world import RankError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.precision import MixedPrecision
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.memory import model_state_bytes
from dplab.reference.zero.train import train_zero

F32 = TrainConfig(steps=50, dtype="float32")


def _train(comm, cfg, zero):
    comm.tracer.enabled = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow, when provoked
        r = train_zero(comm, cfg, zero)
    events = [e.extra for e in comm.tracer.take() if e.kind == "loss_scale"]
    comm.tracer.enabled = False
    return r, events


def rel(params: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(params.astype(np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("reduce_dtype", ["float16", "float32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_lands_within_the_sync_bound_of_float64(worlds, stage, reduce_dtype):
    ref = train_single(replace(F32, dtype="float64")).params
    zero = ZeroConfig(stage=stage, precision=MixedPrecision(reduce_dtype=reduce_dtype))
    results = [r for r, _ in worlds(4).run(_train, F32, zero)]
    err = rel(results[0].params, ref)
    assert 1e-6 < err < 1e-4, err
    assert results[0].params.dtype == np.float32  # the masters
    assert all(r.params.tobytes() == results[0].params.tobytes() for r in results)
    assert results[0].losses[-1] < 0.5 * results[0].losses[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_an_overflow_is_skipped_on_every_rank_alike(worlds, stage):
    """S = 2^40 overflows float16 at once: dynamic scaling skips and backs off on all ranks."""
    cfg = replace(F32, steps=30)
    zero = ZeroConfig(stage=stage, precision=MixedPrecision(init_scale=2.0**40))
    out = worlds(3).run(_train, cfg, zero)
    skips = [e for e in out[0][1] if e["action"] == "skip"]
    assert len(skips) >= 10 and all(events == out[0][1] for _, events in out)
    ref = train_single(replace(cfg, dtype="float64")).params
    assert np.isfinite(out[0][0].params).all() and rel(out[0][0].params, ref) < 0.5


def _memory(comm, cfg, zero):
    r = train_zero(comm, cfg, zero)
    return r.memory, r.shard_elems


@pytest.mark.parametrize("optimizer, k", [("sgd", 0), ("adam", 2)])
@pytest.mark.parametrize("reduce_dtype, G", [("float16", 2), ("float32", 4)])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_memory_is_the_papers_form_plus_the_allowance(
    worlds, optimizer, k, reduce_dtype, G, p, stage
):
    cfg = TrainConfig(
        model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3),
        num_samples=40,
        global_batch=9,
        steps=2,
        dtype="float32",
        optimizer=OptimConfig(optimizer, lr=0.01),
    )
    zero = ZeroConfig(stage=stage, precision=MixedPrecision(reduce_dtype=reduce_dtype))
    sizes = layer_sizes(cfg)
    psi = sum(sizes)
    results = worlds(p).run(_memory, cfg, zero)
    form = model_state_bytes(psi, stage, p, param_bytes=2, grad_bytes=G, state_bytes=4 + 4 * k)
    p_extra = 2 * params_in_flight(sizes, 1, True) if stage == 3 else 0
    for rank, (mem, m) in enumerate(results):
        owned = [(b - a) for a, b in (chunk_bounds(n, p)[rank] for n in sizes)]
        unscaled = 4 * max(sizes if stage == 0 else owned)  # float32 gradient of one layer's part
        grads = G * psi + unscaled if stage < 2 else \
            max(G * (m + grads_in_flight(sizes)), G * m + unscaled)
        assert mem.params == (2 * psi if stage < 3 else 2 * m + p_extra), f"rank {rank}"
        assert mem.grads == grads, f"rank {rank}"
        assert mem.optimizer == (4 + 4 * k) * (psi if stage == 0 else m), f"rank {rank}"
    assert sum(mem.params for mem, _ in results) - p * p_extra == pytest.approx(
        p * form.params, rel=1e-12
    )
    assert sum(mem.optimizer for mem, _ in results) == pytest.approx(p * form.optimizer, rel=1e-12)


def test_float64_masters_are_refused(worlds):
    with pytest.raises(RankError, match="dtype='float32'"):
        worlds(2).run(
            _memory, replace(F32, dtype="float64"), ZeroConfig(precision=MixedPrecision())
        )


@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_ledger_matches_tracemalloc(worlds, stage):
    cfg = TrainConfig(
        model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3),
        num_samples=40,
        global_batch=9,
        steps=1,
        dtype="float32",
        optimizer=OptimConfig("adam", lr=0.01),
    )
    zero = ZeroConfig(stage=stage, accum_steps=2, precision=MixedPrecision(reduce_dtype="float16"))
    for rank, (checks, mismatches) in enumerate(worlds(2).run(_traced_against_ledger, cfg, zero)):
        assert checks >= 3 and mismatches == [], f"rank {rank}: {mismatches[:3]}"
