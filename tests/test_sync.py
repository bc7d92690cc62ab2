"""Synchronous data parallelism == single-device training, on every rank, for any split.

The heart of dplab: whatever the world size, the batch split (uneven, or smaller than
the world), the all-reduce algorithm, the bucket size, the number of micro-batches and
the optimizer, ``train_sync`` must land on the parameters of ``train_single`` (float64:
relative 1e-10, float32: 1e-5), and every rank must hold bitwise the same parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import train_configs
from tiers import engine_spans, engines

from dplab.backends.launch.world import RankError
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

ALGORITHMS = ["naive", "ring", "tree", "direct", "native"]
# 1e-6 MiB is about one byte: every parameter closes its own bucket. 1e-3 MiB (~130 float64)
# groups a few small parameters. 1e3 MiB puts the whole model into one bucket.
BUCKET_CAPS = [1e-6, 2e-4, 1e-3, 1e3]
EXAMPLES = settings.default.max_examples  # the profile's base count (DPLAB_EXAMPLES, default 50)


def rel(a, b) -> float:
    """max|a - b| / max(1, max|b|): relative for large values, absolute near zero."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


# -- rank functions (module level: World.run pickles them) -----------------------------------

def _train(comm, cfg, sync):
    return train_sync(comm, cfg, sync)


def _train_traced(comm, cfg, sync):
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        result = train_sync(comm, cfg, sync)
    finally:
        comm.tracer.enabled = False
    return result, comm.tracer.take()


# -- strategies ------------------------------------------------------------------------------

sync_configs = st.builds(
    SyncConfig,
    algorithm=st.sampled_from(ALGORITHMS),
    bucket_cap_mb=st.sampled_from(BUCKET_CAPS),
    accum_steps=st.integers(1, 4),
)


def check_equals_single(results, cfg: TrainConfig, tol: float) -> None:
    ref = train_single(cfg)
    dtype = np.dtype(cfg.dtype)
    first = results[0]
    assert first.params.dtype == dtype and first.params.shape == ref.params.shape
    assert len(first.losses) == cfg.steps
    err = rel(first.params, ref.params)
    assert err <= tol, f"params differ from train_single by {err:.3g} (relative)"
    loss_err = rel(first.losses, ref.losses)
    assert loss_err <= tol, f"losses {first.losses} vs single {ref.losses}: {loss_err:.3g}"
    for rank, r in enumerate(results):
        assert r.params.dtype == dtype
        assert np.array_equal(r.params, first.params), f"rank {rank} params differ from rank 0's"
        assert r.losses == first.losses, f"rank {rank} logged different losses from rank 0"


# -- data parallel == single device ---------------------------------------------------------

# The sim backend moves the local backend's bytes on a virtual clock, a rank thread at a time:
# its 150 examples up to p = 8 were the suite's slowest test; up to 4 ranks they cover every
# algorithm, uneven and empty shard and bucket split (p = 8 on sim: test_empty_shards...)
SIM_P = 4

# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_train_sync_equals_train_single_float64(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(3 * EXAMPLES), deadline=None)
    @given(data=st.data(), cfg=train_configs(), sync=sync_configs)
    def prop(data, cfg, sync):
        p = data.draw(st.integers(sweep.lo, sweep.hi), label="p")
        p = min(p, SIM_P) if backend == "sim" else p
        results = worlds(p, backend).run(_train, cfg, sync)
        assert len(results) == p
        check_equals_single(results, cfg, 1e-10)

    prop()


# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_train_sync_equals_train_single_float32(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(EXAMPLES), deadline=None)
    @given(data=st.data(), cfg=train_configs("float32"), sync=sync_configs)
    def prop(data, cfg, sync):
        p = data.draw(st.integers(sweep.lo, sweep.hi), label="p")
        results = worlds(p, backend).run(_train, cfg, sync)
        check_equals_single(results, cfg, 1e-5)

    prop()


BASE = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                   global_batch=11, steps=3, seed=3)


# every case on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p, global_batch, accum_steps", engines([
    (5, 3, 1),   # two ranks get an empty shard every step
    (4, 2, 3),   # empty shards and empty micro-batches
    (8, 1, 4),   # a single sample for a world of eight
    (3, 100, 2),  # batch larger than the data set: indices repeat across epochs
]), indirect=["backend"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_shards_and_micro_batches_still_match(
    worlds, backend, p, global_batch, accum_steps, algorithm
):
    cfg = dataclasses.replace(BASE, global_batch=global_batch)
    sync = SyncConfig(algorithm, bucket_cap_mb=1e-6, accum_steps=accum_steps)
    check_equals_single(worlds(p, backend).run(_train, cfg, sync), cfg, 1e-10)


def test_training_actually_moves_the_parameters(worlds):
    """Guard against a vacuous pass: the compared runs do change the parameters."""
    cfg = dataclasses.replace(BASE, steps=4)
    results = worlds(3).run(_train, cfg, SyncConfig("ring", 1e-6, 2))
    initial = setup(cfg)[2]
    assert rel(results[0].params, initial) > 1e-3
    check_equals_single(results, cfg, 1e-10)


# -- the broadcast ---------------------------------------------------------------------------

# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3, 5]), indirect=["backend"])
def test_steps_zero_returns_rank0_initial_params_on_every_rank(worlds, backend, p):
    cfg = dataclasses.replace(BASE, steps=0)
    model, _, initial = setup(cfg)
    # Without the broadcast the other ranks would start elsewhere: the test can tell.
    for rank in range(1, p):
        assert not np.array_equal(model.init_params(cfg.seed + 1 + rank), initial)
    results = worlds(p, backend).run(_train, cfg, SyncConfig("tree"))
    for rank, r in enumerate(results):
        assert r.losses == []
        assert r.params.dtype == initial.dtype
        assert np.array_equal(r.params, initial), f"rank {rank} did not receive rank 0's parameters"


def test_steps_zero_broadcast_float32(worlds):
    cfg = dataclasses.replace(BASE, steps=0, dtype="float32")
    initial = setup(cfg)[2]
    for r in worlds(4).run(_train, cfg, SyncConfig("naive")):
        assert r.params.dtype == np.float32 and np.array_equal(r.params, initial)


# -- overlap and the no_sync micro-batches, seen in the trace ---------------------------------

def test_buckets_overlap_backward(worlds):
    """A bucket's all-reduce starts on the comm thread while backward is still running."""
    cfg = TrainConfig(model=MLPConfig(in_dim=256, hidden=(256, 256, 256), out_dim=256),
                      num_samples=512, global_batch=512, steps=6, seed=1)
    model = MLP(cfg.model)
    # Every W is 512 KiB, every b 2 KiB: with a 513 KiB cap neither alone fills a bucket
    # but W + b does, so each bucket holds exactly one layer.
    cap = 513 / 1024
    results = worlds(2).run(_train_traced, cfg, SyncConfig("ring", cap))
    check_equals_single([r for r, _ in results], cfg, 1e-10)
    overlapped = 0
    for _, events in results:
        buckets = [e for e in events if e.kind == "bucket"]
        assert all(e.thread == "comm" for e in buckets)
        assert len(buckets) == cfg.steps * model.num_layers  # one bucket per layer per step
        backwards = {e.extra["step"]: e for e in events if e.kind == "backward"}
        assert all(e.thread == "main" for e in backwards.values())
        assert sorted(backwards) == list(range(cfg.steps))
        for step in range(cfg.steps):
            bw = backwards[step]
            mine = [e for e in buckets if bw.t_start_ns <= e.t_start_ns]
            mine = [e for e in mine if step + 1 == cfg.steps or
                    e.t_start_ns < backwards[step + 1].t_start_ns]
            assert [e.extra["bucket"] for e in mine] == list(range(model.num_layers))
            assert mine[0].bytes == (model.layer_slice(model.num_layers - 1).stop
                                     - model.layer_slice(model.num_layers - 1).start) * 8
            if mine[0].t_start_ns < bw.t_end_ns:
                overlapped += 1
    assert overlapped >= 1, "no bucket ever started before its step's backward pass ended"


@pytest.mark.parametrize("accum_steps", [1, 3])
def test_no_sync_micro_batches_launch_no_buckets(worlds, accum_steps):
    """Only the last micro-batch of a step reduces: buckets per step == number of buckets."""
    cfg = dataclasses.replace(BASE, global_batch=24, steps=2)
    model = MLP(cfg.model)
    results = worlds(3).run(_train_traced, cfg, SyncConfig("ring", 1e-6, accum_steps))
    check_equals_single([r for r, _ in results], cfg, 1e-10)
    for _, events in results:
        buckets = [e for e in events if e.kind == "bucket"]
        assert len(buckets) == cfg.steps * 2 * model.num_layers  # one bucket per parameter
        backward = [e for e in events if e.kind == "backward"]
        assert len(backward) == cfg.steps * accum_steps
        # no bucket starts before the last micro-batch's backward of its step has begun
        for step in range(cfg.steps):
            last = max(
                (e for e in backward if e.extra["step"] == step), key=lambda e: e.extra["micro"]
            )
            assert last.extra["micro"] == accum_steps - 1
            earlier = [e for e in backward if e.extra["step"] == step and e is not last]
            for e in earlier:
                assert not any(e.t_start_ns <= b.t_start_ns <= e.t_end_ns for b in buckets)


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("sync, field", [
    (SyncConfig(accum_steps=0), "accum_steps"),
    (SyncConfig(accum_steps=-2), "accum_steps"),
    (SyncConfig(bucket_cap_mb=0), "bucket_cap_mb"),
    (SyncConfig(bucket_cap_mb=-1.0), "bucket_cap_mb"),
])
def test_bad_sync_config_is_a_config_error(worlds, sync, field):
    with pytest.raises(ConfigError, match=field):
        sync.validate()
    with pytest.raises(RankError, match="ConfigError") as info:
        worlds(2).run(_train, BASE, sync)
    assert field in str(info.value)


def test_good_sync_configs_validate():
    for algorithm in ALGORITHMS:
        assert SyncConfig(algorithm, 1e-6, 1).validate() is None


def test_unknown_algorithm_is_a_config_error_up_front():
    with pytest.raises(ConfigError, match="bogus"):
        SyncConfig(algorithm="bogus").validate()


@pytest.mark.parametrize("steps", [0, 2])
def test_unknown_algorithm_fails_train_sync_with_a_clear_error(worlds, steps):
    cfg = dataclasses.replace(BASE, steps=steps)
    with pytest.raises(RankError, match="ConfigError") as info:
        worlds(2).run(_train, cfg, SyncConfig(algorithm="bogus"))
    message = str(info.value)
    assert "bogus" in message and "ring" in message  # names the culprit and the choices
    # the world is usable again afterwards
    check_equals_single(worlds(2).run(_train, BASE, SyncConfig("ring")), BASE, 1e-10)
