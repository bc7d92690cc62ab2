"""Synthetic data and batching: deterministic, epoch-wrapping, and sharded without loss."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplab.reference.data import batch_indices, make_dataset, shard
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_make_dataset_is_deterministic_with_the_right_shapes(kind):
    a = make_dataset(kind, n=50, in_dim=3, out_dim=4, seed=1)
    b = make_dataset(kind, n=50, in_dim=3, out_dim=4, seed=1)
    c = make_dataset(kind, n=50, in_dim=3, out_dim=4, seed=2)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    assert a.x.shape == (50, 3) and a.x.dtype == np.float64 and len(a) == 50
    if kind == "regression":
        assert a.y.shape == (50, 4) and a.y.dtype == np.float64
    else:
        assert a.y.shape == (50,) and a.y.dtype == np.int64
        assert set(np.unique(a.y)) <= set(range(4)) and len(np.unique(a.y)) >= 2


def test_float32_data_and_targets_follow_a_teacher():
    data = make_dataset("regression", n=2000, in_dim=4, out_dim=2, seed=0, dtype=np.float32)
    assert data.x.dtype == data.y.dtype == np.float32
    # A teacher, not noise: targets are far more predictable from x than their variance.
    design = np.hstack([np.tanh(data.x @ np.eye(4)), data.x, np.ones((2000, 1))])
    resid = data.y - design @ np.linalg.lstsq(design, data.y, rcond=None)[0]
    assert resid.var() < 0.5 * data.y.var()


def test_data_stream_is_independent_of_init_and_epoch_streams():
    """default_rng(s) == default_rng([s, 0]); the data must not reuse those streams."""
    x = make_dataset("regression", n=5, in_dim=2, out_dim=1, seed=3).x.ravel()
    assert not np.allclose(x, np.random.default_rng(3).standard_normal(10))


def test_bad_dataset_arguments_raise():
    with pytest.raises(ConfigError):
        make_dataset("images", n=5, in_dim=2, out_dim=2, seed=0)
    with pytest.raises(ConfigError):
        make_dataset("classification", n=5, in_dim=2, out_dim=1, seed=0)
    with pytest.raises(ConfigError):
        make_dataset("regression", n=0, in_dim=2, out_dim=2, seed=0)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 20), global_batch=st.integers(1, 45), seed=st.integers(0, 1000),
       steps=st.integers(1, 6))
def test_batches_walk_the_epoch_permutations_end_to_end(n, global_batch, seed, steps):
    """Consecutive batches laid end to end are epoch 0's permutation, then epoch 1's, ..."""
    batches = [batch_indices(n, global_batch, s, seed) for s in range(steps)]
    assert all(b.shape == (global_batch,) and b.dtype == np.int64 for b in batches)
    stream = np.concatenate(batches)
    epochs = -(-len(stream) // n)
    expected = np.concatenate(
        [np.random.default_rng([seed, e]).permutation(n) for e in range(epochs)]
    )[: len(stream)]
    assert np.array_equal(stream, expected)
    # Deterministic and random-access: a later step alone equals the same step in the walk.
    assert np.array_equal(batch_indices(n, global_batch, steps - 1, seed), batches[-1])


def test_one_epoch_visits_every_sample_once_and_epochs_differ():
    first = np.concatenate([batch_indices(12, 4, s, seed=0) for s in range(3)])
    second = np.concatenate([batch_indices(12, 4, s, seed=0) for s in range(3, 6)])
    assert sorted(first) == sorted(second) == list(range(12))
    assert not np.array_equal(first, second)
    straddle = batch_indices(12, 5, step=2, seed=0)  # positions 10..14: epoch 0 then epoch 1
    assert np.array_equal(straddle[:2], np.random.default_rng([0, 0]).permutation(12)[10:])


def test_global_batch_larger_than_the_data_set_repeats_indices():
    idx = batch_indices(3, global_batch=10, step=0, seed=0)
    assert len(idx) == 10 and sorted(set(idx.tolist())) == [0, 1, 2]
    assert np.array_equal(idx, batch_indices(3, 10, 0, 0))


def test_bad_batch_arguments_raise():
    for args in [(0, 1, 0, 0), (5, 0, 0, 0), (5, 2, -1, 0), (5, 2, 0, -1)]:
        with pytest.raises(ConfigError):
            batch_indices(*args)


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(0, 30), world_size=st.integers(1, 9), seed=st.integers(0, 100))
def test_shards_partition_the_batch_in_order(batch, world_size, seed):
    indices = np.random.default_rng(seed).integers(0, 1000, size=batch)
    shards = [shard(indices, r, world_size) for r in range(world_size)]
    assert np.array_equal(np.concatenate(shards), indices)  # nothing lost, nothing repeated
    sizes = [len(s) for s in shards]
    assert sizes == [hi - lo for lo, hi in chunk_bounds(batch, world_size)]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if batch < world_size:
        assert sizes.count(0) == world_size - batch


def test_shard_rejects_bad_ranks():
    for rank, world_size in [(-1, 2), (2, 2), (0, 0)]:
        with pytest.raises(ConfigError):
            shard(np.arange(4), rank, world_size)
