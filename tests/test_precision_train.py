"""Mixed precision in train_sync: how far float16 compute lands from float64, and loss scaling.

Master weights float32, compute float16, gradients reduced in float16 or float32; each run is
compared with the float64 single-device oracle on the same batches. Measured here (4 ranks, ring,
default MLP, 50 SGD steps): relative error of the final parameters 4.0e-5 (reduce float32) and
4.5e-5 (reduce float16), against 1.8e-7 for a plain float32 run. One step's all-reduced gradient:
see ``test_one_gradient_error_by_reduce_dtype``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.collectives import allreduce
from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import ConfigError
from dplab.reference.precision import MixedPrecision, compute_copy
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

F32 = TrainConfig(steps=50, dtype="float32")
# one bucket per layer: half-precision buckets overlap backward
SYNC = SyncConfig(bucket_cap_mb=0.0005)


def rel(params: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(params.astype(np.float64) - ref) / np.linalg.norm(ref))


def traced_train(comm, cfg, sync):
    """train_sync with tracing on; returns (result, this rank's loss-scale events)."""
    comm.tracer.enabled = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow is the point here
        result = train_sync(comm, cfg, sync)
    return result, [e.extra for e in comm.tracer.take() if e.kind == "loss_scale"]


def job_grad(comm, cfg: TrainConfig, reduce_dtype: str, loss_scale: float) -> np.ndarray:
    """Step 0's gradient as mixed precision computes it: float16 forward/backward on each rank's
    shard with the loss scaled, summed in ``reduce_dtype``, unscaled into float32."""
    model, data, master = setup(cfg)
    mine = shard(
        batch_indices(cfg.num_samples, cfg.global_batch, 0, cfg.seed), comm.rank, comm.world_size
    )
    weights = compute_copy(master, np.empty(master.shape, np.float16))
    grad = comm.empty(model.num_params, reduce_dtype)
    grad[:] = 0
    acts = model.forward(weights, data.x[mine])
    for _ in model.backward(weights, acts, data.y[mine], grad, loss_scale / cfg.global_batch):
        pass
    allreduce(comm, grad)
    return grad.astype(np.float32) / np.float32(loss_scale)


@pytest.mark.parametrize("reduce_dtype, bound", [("float32", 1e-4), ("float16", 1e-4)])
def test_final_parameters_vs_float64_single_device(reduce_dtype, bound):
    ref = train_single(replace(F32, dtype="float64")).params
    sync = replace(SYNC, precision=MixedPrecision(reduce_dtype=reduce_dtype))
    results = launch(train_sync, 4, args=(F32, sync))
    err = rel(results[0].params, ref)
    assert 1e-6 < err < bound  # float16 compute (above float32's 1.8e-7), within a measured bound
    assert results[0].params.dtype == np.float32  # the masters
    assert all(r.params.tobytes() == results[0].params.tobytes() for r in results)  # replicas agree
    assert results[0].losses[-1] < 0.5 * results[0].losses[0]  # and it trains


def test_one_gradient_error_by_reduce_dtype():
    """The reduction's share, isolated: step 0's gradient at 8 ranks against float64's."""
    cfg = replace(F32, global_batch=64)
    model, data, master = setup(cfg)
    idx = batch_indices(cfg.num_samples, cfg.global_batch, 0, cfg.seed)
    _, exact = model.loss_and_grad(master.astype(np.float64), data.x[idx].astype(np.float64),
                                   data.y[idx].astype(np.float64), 1 / cfg.global_batch)
    errs = {
        dt: rel(launch(job_grad, 8, args=(cfg, dt, 2.0**10))[0], exact)
        for dt in ("float32", "float16")
    }
    assert 1e-5 < errs["float32"] < 2e-3  # float16 compute: inputs, weights and products rounded
    assert errs["float32"] < errs["float16"] < 4e-3  # + up to 7 roundings of every partial sum


def test_dynamic_scaling_survives_an_overflow_that_static_scaling_does_not():
    """At S = 2**20 the scaled gradient (S / B times a residual) overflows float16 at step 0.
    Dynamic scaling skips and halves until it fits, then grows after growth_interval good steps;
    the same S held static would put inf into the weights, so the run stops there, on every rank."""
    cfg = replace(F32, steps=20)
    dynamic = MixedPrecision(init_scale=2.0**20, growth_interval=5)
    (result, events), *others = launch(
        traced_train, 2, args=(cfg, replace(SYNC, precision=dynamic))
    )
    assert np.isfinite(result.params).all() and np.isfinite(result.losses).all()
    assert result.losses[-1] < 0.6 * result.losses[0]
    assert [(e["step"], e["action"]) for e in events[:6]] == [
        (0, "skip"), (0, "backoff"), (1, "skip"), (1, "backoff"), (2, "skip"), (2, "backoff")]
    assert [e["new_scale"] for e in events[1:6:2]] == [2.0**19, 2.0**18, 2.0**17]
    # 3..7 good
    assert events[6] == {"step": 7, "action": "growth", "scale": 2.0**17, "new_scale": 2.0**18}
    assert all(o[1] == events for o in others)  # every rank scaled alike

    static = replace(dynamic, loss_scale=2.0**20)
    with pytest.raises(RankError, match="step 0: the gradients overflowed float16 .* static loss "
                                        "scale"):
        launch(traced_train, 2, args=(cfg, replace(SYNC, precision=static)))

    fits = replace(dynamic, loss_scale=2.0**16)  # a static scale that fits trains like the rest
    (result, events), _ = launch(traced_train, 2, args=(cfg, replace(SYNC, precision=fits)))
    assert np.isfinite(result.params).all() and events == []


def test_without_precision_nothing_changes():
    """precision=None: the float32 run is the one it was (same bits as the explicit no-op path)."""
    a = launch(train_sync, 2, args=(F32, SYNC))[0].params
    ref32 = train_single(F32).params
    assert a.dtype == np.float32 and rel(a, ref32.astype(np.float64)) < 1e-5


@pytest.mark.parametrize("precision, master, match", [
    (MixedPrecision(), "float64", "float32 master weights"),  # float64 masters refused
    (MixedPrecision(compute_dtype="bfloat16"), "float32", "numpy has no bfloat16"),
    (MixedPrecision(reduce_dtype="float64"), "float32", "reduce_dtype"),
    (MixedPrecision(loss_scale="auto"), "float32", "'dynamic'"),
    (MixedPrecision(loss_scale=0.0), "float32", "static loss_scale"),
    (MixedPrecision(growth_factor=1.0), "float32", "growth_factor"),
    (MixedPrecision(backoff_factor=1.0), "float32", "backoff_factor"),
    (MixedPrecision(growth_interval=0), "float32", "growth_interval"),
    (MixedPrecision(growth_interval=True), "float32", "growth_interval"),
    (MixedPrecision(init_scale=float("inf")), "float32", "init_scale"),
])
def test_bad_precision_is_refused(precision, master, match):
    with pytest.raises(ConfigError, match=match):
        precision.validate(master)
    if master == "float32":
        with pytest.raises(ConfigError, match=match):
            # SyncConfig.validate, on every rank, before any step
            replace(SYNC, precision=precision).validate(2)


def test_float64_masters_are_refused_on_every_rank():
    with pytest.raises(RankError, match="float32 master weights"):
        launch(
            train_sync, 2, args=(TrainConfig(steps=1), replace(SYNC, precision=MixedPrecision()))
        )


def test_dynamic_scale_resumes_exactly_from_a_checkpoint(tmp_path):
    """The loss scale and its growth count are checkpointed: a run resumed after the skips and
    back-offs (and before a growth) ends on the same bits as the uninterrupted one."""
    cfg = replace(F32, steps=9)
    mixed = MixedPrecision(init_scale=2.0**20, growth_interval=5)  # skips 0-2, grows at step 7
    every = CheckpointConfig(every=4, directory=str(tmp_path))
    whole = launch(train_sync, 2, args=(cfg, replace(SYNC, precision=mixed, checkpoint=every)))
    again = CheckpointConfig(resume=str(tmp_path / "ckpt-00000004.npz"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow, on purpose
        resumed = launch(
            train_sync, 2, args=(cfg, replace(SYNC, precision=mixed, checkpoint=again))
        )
    # the scale at step 4, growth not kept
    fresh = MixedPrecision(init_scale=2.0**17, growth_interval=5)
    wrong = launch(train_sync, 2, args=(cfg, replace(SYNC, precision=fresh)))
    assert (
        np.array_equal(resumed[0].params, whole[0].params) and resumed[0].losses == whole[0].losses
    )
    assert not np.array_equal(wrong[0].params, whole[0].params)  # so the kept state mattered


