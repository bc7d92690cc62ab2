"""Schedules as data, checked by the simulator: provenance (who is counted where) and values.

Buffers are random int64, so "equals the sum" is exact, and the simulator's provenance
counts catch what a lucky sum could hide (a contribution counted twice, another never).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dplab.reference.algorithms import (
    ALGORITHMS,
    ALLREDUCE,
    allreduce_schedule,
    direct,
    naive,
    ring,
    tree,
)
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.schedule import Schedule, ScheduleError, Transfer, chunk_bounds, concat
from dplab.reference.simulate import initial_holdings, is_allreduce, simulate

WORLD_SIZES = range(1, 17)
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 101)
ROOTED = {"tree": (tree.reduce, tree.broadcast), "naive": (naive.reduce, naive.broadcast)}
SCATTER = {"ring": (ring.reduce_scatter, ring.allgather),
           "direct": (direct.reduce_scatter, direct.allgather)}


def lengths_for(p: int) -> list[int]:
    """0, 1, primes, every n < p, and the lengths right around multiples of p."""
    return sorted({0, 1, *PRIMES, *range(p), p, p + 1, 2 * p - 1, 3 * p + 2})


def random_buffers(p: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, p, n])
    return [rng.integers(-(10**12), 10**12, size=n, dtype=np.int64) for _ in range(p)]


# -- all-reduce ----------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE))
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_allreduce_counts_every_contribution_exactly_once_and_sums(algorithm, p):
    schedule = allreduce_schedule(algorithm, p)
    assert schedule.world_size == p and schedule.name == algorithm
    provenance = simulate(schedule)
    assert provenance.buffers is None
    assert len(provenance.holdings) == len(schedule.rounds) + 1
    np.testing.assert_array_equal(provenance.holdings[0], initial_holdings(p, schedule.num_chunks))
    final = provenance.holdings[-1]
    assert final.shape == (p, schedule.num_chunks, p)
    np.testing.assert_array_equal(final, np.ones_like(final))
    assert is_allreduce(provenance)
    for n in lengths_for(p):
        bufs = random_buffers(p, n, seed=1)
        originals = [b.copy() for b in bufs]
        sim = simulate(schedule, bufs)
        expected = np.sum(bufs, axis=0, dtype=np.int64)
        assert len(sim.buffers) == p
        for rank, out in enumerate(sim.buffers):
            assert out.dtype == np.int64 and out.shape == (n,)
            np.testing.assert_array_equal(out, expected, err_msg=f"{algorithm} p={p} n={n} rank "
                                                                 f"{rank}")
        for b, o in zip(bufs, originals):  # the simulator works on copies
            np.testing.assert_array_equal(b, o)
        np.testing.assert_array_equal(sim.holdings[-1], final)  # provenance ignores the values


@given(algorithm=st.sampled_from(sorted(ALLREDUCE)), p=st.integers(1, 16),
       n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_allreduce_sum_property(algorithm, p, n, seed):
    bufs = random_buffers(p, n, seed)
    sim = simulate(allreduce_schedule(algorithm, p), bufs)
    expected = np.sum(bufs, axis=0, dtype=np.int64)
    assert all(np.array_equal(out, expected) for out in sim.buffers)


def test_simulator_catches_a_contribution_counted_twice():
    # rank 0's chunk reaches rank 1 twice: right sum of counts, wrong provenance.
    twice = Schedule("bad", 2, 1, ((Transfer(0, 1, 0, "reduce"),), (Transfer(0, 1, 0, "reduce"),),
                                   (Transfer(1, 0, 0, "copy"),)))
    sim = simulate(twice, [np.array([1]), np.array([10])])
    assert not is_allreduce(sim)
    np.testing.assert_array_equal(sim.holdings[-1][1, 0], [2, 1])
    np.testing.assert_array_equal(sim.buffers[0], [12])


def test_simulate_rejects_the_wrong_number_of_buffers():
    with pytest.raises(ValueError, match="need 3 buffers"):
        simulate(allreduce_schedule("ring", 3), [np.zeros(4, np.int64)] * 2)


# -- reduce-scatter, all-gather, broadcast, reduce -------------------------------------------

@pytest.mark.parametrize("algorithm", sorted(SCATTER))
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_reduce_scatter_leaves_rank_r_owning_chunk_r(algorithm, p):
    schedule = SCATTER[algorithm][0](p)
    assert schedule.num_chunks == p
    final = simulate(schedule).holdings[-1]
    for r in range(p):
        np.testing.assert_array_equal(final[r, r], np.ones(p, np.int64), err_msg=f"rank {r}")
    for n in lengths_for(p):
        bufs = random_buffers(p, n, seed=2)
        total = np.sum(bufs, axis=0, dtype=np.int64)
        sim = simulate(schedule, bufs)
        for r, (a, b) in enumerate(chunk_bounds(n, p)):
            np.testing.assert_array_equal(sim.buffers[r][a:b], total[a:b], err_msg=f"p={p} n={n} "
                                                                                   f"r={r}")


@pytest.mark.parametrize("algorithm", sorted(SCATTER))
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_allgather_gives_everyone_every_owners_chunk(algorithm, p):
    schedule = SCATTER[algorithm][1](p)
    final = simulate(schedule).holdings[-1]
    for r in range(p):
        for c in range(p):
            np.testing.assert_array_equal(final[r, c], np.eye(p, dtype=np.int64)[c])
    for n in lengths_for(p):
        bufs = random_buffers(p, n, seed=3)
        bounds = chunk_bounds(n, p)
        expected = np.concatenate([bufs[c][a:b] for c, (a, b) in enumerate(bounds)])
        for r, out in enumerate(simulate(schedule, bufs).buffers):
            np.testing.assert_array_equal(out, expected, err_msg=f"p={p} n={n} rank {r}")


@pytest.mark.parametrize("algorithm", sorted(ROOTED))
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_broadcast_from_any_root_gives_everyone_the_roots_data(algorithm, p):
    for root in range(p):
        schedule = ROOTED[algorithm][1](p, root)
        final = simulate(schedule).holdings[-1]
        np.testing.assert_array_equal(final[:, 0], np.tile(np.eye(p, dtype=np.int64)[root], (p, 1)))
        for n in (0, 1, 7, p + 3):
            bufs = random_buffers(p, n, seed=root)
            for r, out in enumerate(simulate(schedule, bufs).buffers):
                np.testing.assert_array_equal(out, bufs[root], err_msg=f"root {root} rank {r}")


@pytest.mark.parametrize("algorithm", sorted(ROOTED))
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_reduce_to_any_root_gives_the_root_the_sum(algorithm, p):
    for root in range(p):
        schedule = ROOTED[algorithm][0](p, root)
        np.testing.assert_array_equal(
            simulate(schedule).holdings[-1][root, 0], np.ones(p, np.int64)
        )
        for n in (0, 1, 7, p + 3):
            bufs = random_buffers(p, n, seed=root + 100)
            out = simulate(schedule, bufs).buffers[root]
            np.testing.assert_array_equal(out, np.sum(bufs, axis=0, dtype=np.int64))


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_tree_rounds_pair_each_rank_at_most_once_and_ring_talks_right(p):
    for schedule in (tree.reduce(p, p // 2), tree.broadcast(p, p - 1), tree.allreduce(p)):
        for rnd in schedule.rounds:
            ranks = [r for t in rnd for r in (t.src, t.dst)]
            assert len(ranks) == len(set(ranks)), rnd
    for rnd in ring.allreduce(p).rounds:
        assert sorted(t.src for t in rnd) == list(range(p))
        assert all(t.dst == (t.src + 1) % p for t in rnd)


# -- round counts --------------------------------------------------------------------------

@pytest.mark.parametrize("p", WORLD_SIZES)
def test_round_counts(p):
    lg = math.ceil(math.log2(p))
    expected = {"ring": 2 * (p - 1), "tree": 2 * lg, "naive": 2 if p > 1 else 0,
                "direct": 2 if p > 1 else 0}
    for algorithm, rounds in expected.items():
        assert len(allreduce_schedule(algorithm, p).rounds) == rounds, algorithm
    assert len(ring.reduce_scatter(p).rounds) == len(ring.allgather(p).rounds) == p - 1
    assert len(tree.reduce(p).rounds) == len(tree.broadcast(p).rounds) == lg
    if p == 1:
        assert all(len(allreduce_schedule(a, 1).rounds) == 0 for a in ALLREDUCE)


def test_ring_matches_its_docstring_for_p4():
    s = ring.allreduce(4)
    # reduce-scatter round k: rank r sends chunk (r - k - 1) mod p; all-gather: (r - k) mod p
    assert [t.chunk for t in s.rounds[0]] == [3, 0, 1, 2]
    assert all(t.op == "reduce" for rnd in s.rounds[:3] for t in rnd)
    assert [t.chunk for t in s.rounds[3]] == [0, 1, 2, 3]
    assert all(t.op == "copy" for rnd in s.rounds[3:] for t in rnd)


def test_allreduce_schedule_rejects_unknown_algorithms_and_bad_world_sizes():
    with pytest.raises(ConfigError) as err:
        allreduce_schedule("butterfly", 4)
    assert all(name in str(err.value) for name in ALLREDUCE)
    with pytest.raises(ConfigError, match="native"):
        allreduce_schedule("native", 4)
    with pytest.raises(ConfigError, match="world_size"):
        allreduce_schedule("ring", 0)
    assert set(ALGORITHMS) == {*ALLREDUCE, "native"}


def test_allreduce_schedule_is_cached_and_immutable():
    assert allreduce_schedule("ring", 5) is allreduce_schedule("ring", 5)
    with pytest.raises(AttributeError):
        allreduce_schedule("ring", 5).world_size = 6  # type: ignore[misc]


# -- chunk_bounds --------------------------------------------------------------------------

@given(n=st.integers(0, 100_000), k=st.integers(1, 200))
def test_chunk_bounds_partition_balanced_larger_first(n, k):
    bounds = chunk_bounds(n, k)
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))  # contiguous, no gaps or overlap
    sizes = [b - a for a, b in bounds]
    assert all(s >= 0 for s in sizes) and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger pieces come first
    assert sizes.count(n // k + 1) == (n % k if n % k else 0)


def test_chunk_bounds_examples_and_errors():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 3) == [(0, 0)] * 3
    for n, k in ((-1, 2), (3, 0), (0, -1)):
        with pytest.raises(ValueError):
            chunk_bounds(n, k)


# -- validation ----------------------------------------------------------------------------

def make(p: int, k: int, *rounds: tuple[Transfer, ...]) -> Schedule:
    return Schedule("t", p, k, tuple(rounds))


@pytest.mark.parametrize("bad", [
    Transfer(-1, 0, 0, "reduce"), Transfer(3, 0, 0, "reduce"), Transfer(0, -1, 0, "copy"),
    Transfer(0, 3, 0, "copy"), Transfer(0, 1, -1, "copy"), Transfer(0, 1, 2, "copy"),
], ids=["src<0", "src>=p", "dst<0", "dst>=p", "chunk<0", "chunk>=k"])
def test_schedule_rejects_out_of_range(bad):
    with pytest.raises(ScheduleError, match="out of range"):
        make(3, 2, (Transfer(1, 2, 0, "reduce"), bad))


def test_schedule_rejects_self_sends_unknown_ops_and_empty_worlds():
    with pytest.raises(ScheduleError, match="itself"):
        make(3, 1, (Transfer(1, 1, 0, "copy"),))
    with pytest.raises(ScheduleError, match="unknown op"):
        make(3, 1, (Transfer(0, 1, 0, "max"),))  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"src, dst and chunk must be integers \(p // 2, not p "
                                            r"/ 2\)"):
        make(3, 2, (Transfer(0, 1, 1.0, "copy"),))  # a chunk p / 2 would be cut short, not refused
    with pytest.raises(ScheduleError, match="is not a Transfer"):
        make(3, 2, ((0, 1, 1, "copy"),))  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        make(0, 1)
    with pytest.raises(ScheduleError):
        make(2, 0)


@pytest.mark.parametrize("order", ["copy-first", "reduce-first"])
def test_schedule_rejects_a_copy_and_another_receive_into_one_chunk(order):
    """Sending a chunk while receiving into it is legal (the send is a snapshot:
    test_alg_recursive_*); a copy landing in a chunk that another message also lands in has no
    defined order."""
    pair = [Transfer(0, 1, 0, "reduce"), Transfer(2, 1, 0, "copy")]
    rnd = tuple(pair if order == "reduce-first" else reversed(pair))
    with pytest.raises(ScheduleError, match="rank 1 receives chunk 0 twice, once as a copy"):
        make(3, 2, rnd)


def test_schedule_accepts_what_is_legal():
    # rank 1 receives chunk 0 and sends chunk 1 in one round; forwards chunk 0 in the next;
    # one rank may send the same chunk to many peers; ranks may receive from many.
    s = make(3, 2, (Transfer(0, 1, 0, "reduce"), Transfer(1, 2, 1, "copy")),
             (Transfer(1, 2, 0, "copy"), Transfer(1, 0, 0, "copy")))
    assert s.transfers_of(1) == [([Transfer(1, 2, 1, "copy")], [Transfer(0, 1, 0, "reduce")]),
                                 ([Transfer(1, 2, 0, "copy"), Transfer(1, 0, 0, "copy")], [])]
    assert s.transfers_of(2) == [
        ([], [Transfer(1, 2, 1, "copy")]),
        ([], [Transfer(1, 2, 0, "copy")]),
    ]


def test_concat_requires_the_same_world_and_chunking():
    assert concat("x", ring.reduce_scatter(3), ring.allgather(3)).rounds == ring.allreduce(3).rounds
    with pytest.raises(ScheduleError, match="disagree"):
        concat("x", ring.reduce_scatter(3), ring.allgather(4))
    with pytest.raises(ScheduleError, match="disagree"):
        concat("x", ring.reduce_scatter(3), tree.broadcast(3))


def test_schedule_error_belongs_to_the_dplab_error_family():
    """DESIGN: every error dplab raises on purpose subclasses DplabError."""
    assert issubclass(ScheduleError, ValueError)
    assert issubclass(ScheduleError, DplabError)


def test_every_schedule_pickles_to_an_equal_one():
    """``st.cache_data`` and persistent worlds pickle schedules: the columns must travel whole."""
    import pickle

    from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule

    for name in ALLREDUCE:
        for p in (1, 2, 5):
            s = allreduce_schedule(name, p)
            back = pickle.loads(pickle.dumps(s))
            assert back == s and back.rounds == s.rounds and back.name == s.name
