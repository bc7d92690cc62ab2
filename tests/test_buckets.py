"""Buckets: how parameters are grouped, and the Reducer that all-reduces them during backward.

``assign_buckets`` is pure and tested directly. The ``Reducer`` needs real peers, so it
runs on persistent worlds of 2-4 ranks: gradients are integer-valued floats, so the
all-reduced sums are exact and can be compared with ``==``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplab.backends.launch.world import RankError
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.train.buckets import Reducer, assign_buckets

TINY, HUGE = 1e-9, 1e6  # MiB: one parameter per bucket / everything in one bucket
ALGORITHMS = ["naive", "ring", "tree", "direct", "native"]
EXAMPLES = settings.default.max_examples  # the profile's base count (DPLAB_EXAMPLES)


def layout(sizes) -> list[slice]:
    """Parameters laid out one after another in forward order, as the MLP does."""
    bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def local_grad(seed: int, rank: int, step: int, n: int) -> np.ndarray:
    """Integer-valued float64 gradients: sums over ranks are exact in any order."""
    return np.random.default_rng([seed, rank, step]).integers(-1000, 1000, n).astype(np.float64)


def summed_grad(seed: int, p: int, step: int, n: int) -> np.ndarray:
    return sum(local_grad(seed, r, step, n) for r in range(p))


def bucket_events(comm) -> list[int]:
    return [e.extra["bucket"] for e in comm.tracer.events if e.kind == "bucket"]


def wait_for_buckets(comm, count: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(bucket_events(comm)) < count and time.monotonic() < deadline:
        time.sleep(0.001)
    return bucket_events(comm)


# -- assign_buckets --------------------------------------------------------------------------

def nbytes(slices, ids, itemsize) -> int:
    return sum(slices[i].stop - slices[i].start for i in ids) * itemsize


@settings(max_examples=4 * EXAMPLES, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=12),
       itemsize=st.sampled_from([4, 8]),
       cap_bytes=st.integers(1, 2048))
def test_assign_buckets_partition_reverse_contiguous_greedy(sizes, itemsize, cap_bytes):
    slices = layout(sizes)
    cap_mb = cap_bytes / 2**20
    buckets = assign_buckets(slices, itemsize, cap_mb)
    n = len(sizes)
    # every parameter exactly once, in reverse (backward) order
    assert [i for b in buckets for i in b] == list(reversed(range(n)))
    assert all(b for b in buckets)
    for b in buckets:
        # consecutive indices, so one contiguous flat range of exactly their sizes
        assert b == list(range(b[0], b[0] - len(b), -1))
        lo, hi = slices[b[-1]].start, slices[b[0]].stop
        assert hi - lo == sum(sizes[i] for i in b)
    # greedy: a bucket closes as soon as it holds >= cap bytes, and not before, except
    # that a parameter larger than the cap may close the bucket in front of it
    for k, b in enumerate(buckets):
        if k < len(buckets) - 1:
            nxt = buckets[k + 1][0]
            assert (nbytes(slices, b, itemsize) >= cap_bytes
                    or nbytes(slices, [nxt], itemsize) >= cap_bytes)
        assert nbytes(slices, b[:-1], itemsize) < cap_bytes


@pytest.mark.parametrize("sizes", [[1], [3, 1, 4, 1, 5], [100, 2, 7]])
def test_tiny_cap_one_parameter_per_bucket(sizes):
    assert assign_buckets(layout(sizes), 8, TINY) == [[i] for i in reversed(range(len(sizes)))]
    assert assign_buckets(layout(sizes), 4, 1e-6) == [[i] for i in reversed(range(len(sizes)))]


@pytest.mark.parametrize("sizes", [[1], [3, 1, 4, 1, 5], [100, 2, 7]])
def test_huge_cap_one_bucket(sizes):
    assert assign_buckets(layout(sizes), 8, HUGE) == [list(reversed(range(len(sizes))))]


def test_no_parameters_no_buckets():
    assert assign_buckets([], 8, 1.0) == []


@pytest.mark.parametrize("sizes, expected", [
    # the big one comes last in backward order and closes the bucket
    ([100, 2, 3], [[2, 1, 0]]),
    ([2, 100, 3], [[2, 1], [0]]),    # ... in the middle: it closes the bucket a small one opened
    ([2, 3, 100], [[2], [1, 0]]),    # ... first: alone, it fills a bucket by itself
    ([100, 10], [[1, 0]]),           # W then b, the MLP layout: b opens the bucket, W closes it
])
def test_parameter_larger_than_cap_closes_its_bucket(sizes, expected):
    """As in torch DDP: a bucket closes once it reaches the cap; parameters are never split."""
    cap_mb = 50 * 8 / 2**20  # 50 float64: smaller than the big parameter, larger than the others
    assert assign_buckets(layout(sizes), 8, cap_mb) == expected


def test_mlp_layers_one_bucket_each():
    """The cap test_sync's overlap test relies on: each W (512 KiB) < cap <= W + b (514 KiB)."""
    model = MLP(MLPConfig(in_dim=256, hidden=(256, 256, 256), out_dim=256))
    buckets = assign_buckets(model.param_slices, 8, 513 / 1024)
    assert buckets == [[7, 6], [5, 4], [3, 2], [1, 0]]


@pytest.mark.parametrize("cap", [0, -1.0, -1e-9])
def test_assign_buckets_rejects_nonpositive_cap(cap):
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        assign_buckets(layout([1, 2]), 8, cap)


# -- Reducer rank functions (module level: World.run pickles them) ---------------------------

def _reduce_in_any_order(comm, sizes, cap, algorithm, seed, steps):
    """Each step: local gradients, params marked in a per-rank random order, wait."""
    slices = layout(sizes)
    n = slices[-1].stop
    grad = comm.empty(n, np.float64)
    comm.tracer.take()
    comm.tracer.enabled = True
    reducer = Reducer(comm, grad, slices, cap, algorithm)
    out = []
    try:
        for step in range(steps):
            grad[:] = local_grad(seed, comm.rank, step, n)
            reducer.reset()
            order = np.random.default_rng([seed, comm.rank, step, 7]).permutation(len(sizes))
            for i in order:
                reducer.mark_param_as_ready(int(i))
            reducer.wait()
            launched = bucket_events(comm)
            comm.tracer.take()
            out.append((grad.copy(), launched))
    finally:
        reducer.close()
        comm.tracer.enabled = False
        comm.tracer.take()
    return reducer.buckets, out


def _launch_as_soon_as_ready(comm, sizes, seed):
    """Tiny cap: bucket k is parameter n-1-k. Bucket 1 alone must wait for bucket 0."""
    slices = layout(sizes)
    n, m = slices[-1].stop, len(sizes)
    grad = comm.empty(n, np.float64)
    grad[:] = local_grad(seed, comm.rank, 0, n)
    mine = grad.copy()
    comm.tracer.take()
    comm.tracer.enabled = True
    reducer = Reducer(comm, grad, slices, TINY, "ring")
    try:
        reducer.mark_param_as_ready(m - 2)  # bucket 1 complete, bucket 0 not: nothing may start
        time.sleep(0.05)
        early = (bucket_events(comm), grad.copy())
        reducer.mark_param_as_ready(m - 1)  # now buckets 0 and 1 go, in that order
        launched = wait_for_buckets(comm, 2)
        mid = grad.copy()
        rest = np.random.default_rng([seed, comm.rank]).permutation(m - 2)
        for i in rest:
            reducer.mark_param_as_ready(int(i))
        reducer.wait()
        final = (bucket_events(comm), grad.copy())
    finally:
        reducer.close()
        comm.tracer.enabled = False
        comm.tracer.take()
    return mine, early, launched, mid, final


def _wait_too_early(comm, sizes, seed):
    slices = layout(sizes)
    n, m = slices[-1].stop, len(sizes)
    grad = comm.empty(n, np.float64)
    grad[:] = local_grad(seed, comm.rank, 0, n)
    reducer = Reducer(comm, grad, slices, TINY, "tree")
    errors = []
    try:
        for ready in ([], [m - 1, 0]):  # nothing ready; bucket 0 launched, the others not
            for i in ready:
                reducer.mark_param_as_ready(i)
            try:
                reducer.wait()
                errors.append(None)
            except ConfigError as e:
                errors.append(str(e))
        for i in range(1, m - 1):
            reducer.mark_param_as_ready(i)
        reducer.wait()
    finally:
        reducer.close()
    return errors, grad.copy()


def _no_sync_then_sync(comm, sizes, cap, seed):
    slices = layout(sizes)
    n, m = slices[-1].stop, len(sizes)
    grad = comm.empty(n, np.float64)
    grad[:] = local_grad(seed, comm.rank, 0, n)  # micro-batch 0
    comm.tracer.take()
    comm.tracer.enabled = True
    reducer = Reducer(comm, grad, slices, cap, "ring")
    try:
        with reducer.no_sync():
            for i in np.random.default_rng([seed, comm.rank]).permutation(m):
                reducer.mark_param_as_ready(int(i))
        time.sleep(0.05)
        after_no_sync = (bucket_events(comm), grad.copy())
        grad += local_grad(seed, comm.rank, 1, n)  # micro-batch 1 accumulates
        for i in np.random.default_rng([seed, comm.rank, 1]).permutation(m):
            reducer.mark_param_as_ready(int(i))
        reducer.wait()
        final = (bucket_events(comm), grad.copy())
    finally:
        reducer.close()
        comm.tracer.enabled = False
        comm.tracer.take()
    return after_no_sync, final, len(reducer.buckets)


def _mark_twice(comm, sizes, cap, twice):
    """Mark ``twice`` twice; report the outcome and any bucket that started meanwhile."""
    slices = layout(sizes)
    grad = comm.empty(slices[-1].stop, np.float64)
    grad[:] = local_grad(0, comm.rank, 0, grad.size)
    comm.tracer.take()
    comm.tracer.enabled = True
    reducer = Reducer(comm, grad, slices, cap, "ring")
    try:
        reducer.mark_param_as_ready(twice)
        try:
            reducer.mark_param_as_ready(twice)
            outcome = "no error"
        except ConfigError as e:
            outcome = f"ConfigError: {e}"
        time.sleep(0.05)
        # buckets that started although one of their parameters was never marked
        premature = [b for b in bucket_events(comm) if any(i != twice for i in reducer.buckets[b])]
    finally:
        reducer.close()  # every rank did the same, so whatever was launched completes everywhere
        comm.tracer.enabled = False
        comm.tracer.take()
    return outcome, premature


def _bad_reducer(comm, slices, cap):
    grad = comm.empty(max(s.stop for s in slices), np.float64)
    try:
        Reducer(comm, grad, slices, cap).close()
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "no error"


# -- Reducer ---------------------------------------------------------------------------------

@settings(max_examples=2 * EXAMPLES, deadline=None)
@given(p=st.integers(2, 4),
       sizes=st.lists(st.integers(1, 20), min_size=1, max_size=8),
       cap=st.sampled_from([TINY, 40 / 2**20, 200 / 2**20, HUGE]),
       algorithm=st.sampled_from(ALGORITHMS),
       seed=st.integers(0, 2**16),
       steps=st.integers(1, 3))
def test_reducer_any_mark_order_gives_the_sum_in_bucket_order(worlds, p, sizes, cap, algorithm,
                                                             seed, steps):
    results = worlds(p).run(_reduce_in_any_order, sizes, cap, algorithm, seed, steps)
    n = sum(sizes)
    expected_buckets = assign_buckets(layout(sizes), 8, cap)
    for buckets, out in results:
        assert buckets == expected_buckets
        assert len(out) == steps
        for step, (grad, launched) in enumerate(out):
            assert np.array_equal(grad, summed_grad(seed, p, step, n))
            assert launched == list(range(len(buckets))), "buckets must launch in bucket order"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_reducer_launches_a_bucket_as_soon_as_it_and_its_predecessors_are_ready(worlds, p):
    sizes = [4, 3, 5, 2, 6, 1]
    n = sum(sizes)
    slices = layout(sizes)
    total = summed_grad(11, p, 0, n)
    b0, b1 = slices[-1], slices[-2]
    for mine, (early, early_grad), launched, mid, (final, final_grad) in worlds(p).run(
            _launch_as_soon_as_ready, sizes, 11):
        assert early == [] and np.array_equal(early_grad, mine), "bucket 1 started before bucket 0"
        assert launched[:2] == [0, 1]
        assert np.array_equal(mid[b0], total[b0]) and np.array_equal(mid[b1], total[b1])
        assert np.array_equal(mid[: b1.start], mine[: b1.start]), "unready buckets were reduced"
        assert final == list(range(len(sizes)))
        assert np.array_equal(final_grad, total)


@pytest.mark.parametrize("p", [2, 4])
def test_reducer_wait_before_everything_is_ready_is_a_config_error(worlds, p):
    sizes = [3, 1, 4, 1, 5]
    for errors, grad in worlds(p).run(_wait_too_early, sizes, 5):
        assert len(errors) == 2
        assert errors[0] is not None and "0 of 5 buckets" in errors[0]
        assert errors[1] is not None and "1 of 5 buckets" in errors[1]
        assert np.array_equal(grad, summed_grad(5, p, 0, sum(sizes)))  # recovers afterwards


@pytest.mark.parametrize("cap", [TINY, 40 / 2**20, HUGE])
@pytest.mark.parametrize("p", [2, 3])
def test_reducer_no_sync_launches_nothing_then_reduces_the_accumulated_sum(worlds, p, cap):
    sizes = [5, 2, 7, 3]
    n = sum(sizes)
    expected = summed_grad(9, p, 0, n) + summed_grad(9, p, 1, n)
    for rank, ((launched, local), (final_launched, final), nb) in enumerate(
            worlds(p).run(_no_sync_then_sync, sizes, cap, 9)):
        assert launched == [], "no_sync launched a reduction"
        assert np.array_equal(local, local_grad(9, rank, 0, n)), "no_sync changed the gradient"
        assert final_launched == list(range(nb))
        assert np.array_equal(final, expected)


@pytest.mark.parametrize("p", [2, 3])
def test_reducer_marking_a_single_parameter_bucket_twice_is_a_config_error(worlds, p):
    for outcome, premature in worlds(p).run(_mark_twice, [3, 4, 2], TINY, 1):
        assert outcome.startswith("ConfigError") and "twice" in outcome
        assert premature == []


@pytest.mark.parametrize("p", [2, 3])
def test_reducer_marking_twice_in_a_shared_bucket_is_a_config_error(worlds, p):
    """Two parameters in one bucket: marking one of them twice must not count as both."""
    for outcome, premature in worlds(p).run(_mark_twice, [3, 4], HUGE, 1):
        assert premature == [], (
            "the bucket was all-reduced while parameter 0 was never marked ready"
        )
        assert outcome.startswith("ConfigError") and "twice" in outcome, outcome


@pytest.mark.parametrize("slices, cap, needle", [
    ([slice(0, 2), slice(3, 5)], HUGE, "contiguous"),  # a gap between the parameters
    ([slice(0, 2), slice(2, 4)], 0.0, "bucket_cap_mb"),
])
def test_reducer_rejects_bad_layouts_and_caps(worlds, slices, cap, needle):
    for outcome in worlds(2).run(_bad_reducer, slices, cap):
        assert outcome.startswith("ConfigError") and needle in outcome


def test_reducer_error_in_a_rank_function_surfaces_as_rank_error(worlds):
    with pytest.raises(RankError, match="ConfigError"):
        worlds(2).run(_reduce_in_any_order, [1, 2], -1.0, "ring", 0, 1)
