"""The executor on every installed backend (the conformance suite), on persistent worlds.

Every rank builds its own data from ``(seed, rank)``, so the test process knows the exact
answer without shipping the inputs. Integer-valued floats make sums exact in every dtype;
one property uses arbitrary floats and checks that all ranks still agree bit for bit.
Buffers come from ``comm.empty`` (shared memory: the zero-copy path) or ``np.empty``
(copied into a staging segment first).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import engine_spans, engines

from dplab.reference import collectives
from dplab.reference.algorithms import ALLREDUCE, SCATTER_ALGORITHMS
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds

BASE = settings.default.max_examples
ALGORITHMS = (*ALLREDUCE, "native")  # the registry: a new algorithm joins the suite by registering
DTYPES = ("float32", "float64", "int64", "int32")
SPECIAL_LENGTHS = (0, 1, 2, 3, 5, 7, 11, 13, 31, 97, 101, 10_007)
ALLOCS = ("shm", "numpy")


# -- what runs on the ranks (module level: pickled to the persistent worlds) ----------------

def rank_data(seed: int, rank: int, shape, dtype: str, kind: str = "int") -> np.ndarray:
    """Rank ``rank``'s contribution: small integers (exact sums in any dtype) or normals."""
    rng = np.random.default_rng([seed, rank])
    if kind == "int":
        return rng.integers(-1000, 1001, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


def alloc(comm, shape, dtype: str, how: str) -> np.ndarray:
    return comm.empty(shape, dtype) if how == "shm" else np.empty(shape, dtype)


def job_allreduce(comm, algorithm, dtype, shape, op, how, seed, kind="int"):
    buf = alloc(comm, shape, dtype, how)
    buf[...] = rank_data(seed, comm.rank, shape, dtype, kind)
    out = collectives.allreduce(comm, buf, algorithm=algorithm, op=op)
    return out is buf, buf.shape, np.array(buf, copy=True)


def job_reduce_scatter(comm, algorithm, dtype, n, how, seed):
    buf = alloc(comm, n, dtype, how)
    buf[...] = rank_data(seed, comm.rank, n, dtype)
    mine = collectives.reduce_scatter(comm, buf, algorithm=algorithm)
    return np.shares_memory(mine, buf) or mine.size == 0, np.array(mine, copy=True)


def job_allgather(comm, algorithm, dtype, n, how, seed):
    buf = alloc(comm, n, dtype, how)
    buf[...] = -(comm.rank + 1)  # garbage everywhere but this rank's own chunk
    a, b = chunk_bounds(n, comm.world_size)[comm.rank]
    buf[a:b] = rank_data(seed, comm.rank, n, dtype)[a:b]
    out = collectives.allgather(comm, buf, algorithm=algorithm)
    return out is buf, np.array(buf, copy=True)


def job_rooted(comm, kind, algorithm, root, dtype, n, how, seed):
    buf = alloc(comm, n, dtype, how)
    if kind == "broadcast":
        buf[...] = rank_data(seed, comm.rank, n, dtype) if comm.rank == root else -7
        out = collectives.broadcast(comm, buf, root=root, algorithm=algorithm)
    else:
        buf[...] = rank_data(seed, comm.rank, n, dtype)
        out = collectives.reduce(comm, buf, root=root, algorithm=algorithm)
    return out is buf, np.array(buf, copy=True)


def job_error(comm, call: str):
    """Run a misuse on every rank; return the error (type name, message) instead of raising."""
    buf = comm.empty(12, "float64")
    calls = {
        "mean-int": lambda: collectives.allreduce(comm, np.zeros(12, np.int64), op="mean"),
        "mean-int32": lambda: collectives.allreduce(comm, np.zeros(12, np.int32), "ring", "mean"),
        "noncontiguous": lambda: collectives.allreduce(comm, np.zeros((4, 6))[:, ::2]),
        "noncontiguous-shm": lambda: collectives.allreduce(comm, buf[::2], "tree"),
        "unknown-algorithm": lambda: collectives.allreduce(comm, buf, algorithm="butterfly"),
        "bad-op": lambda: collectives.allreduce(comm, buf, op="max"),
        "complex64": lambda: collectives.allreduce(comm, np.zeros(4, np.complex64)),
        "list": lambda: collectives.allreduce(comm, [1.0, 2.0]),
        "list-mean": lambda: collectives.allreduce(comm, [1.0, 2.0], op="mean"),
        "scatter-tree": lambda: collectives.reduce_scatter(comm, buf, algorithm="tree"),
        "broadcast-ring": lambda: collectives.broadcast(comm, buf, algorithm="ring"),
        "broadcast-root": lambda: collectives.broadcast(comm, buf, root=comm.world_size),
        "reduce-root": lambda: collectives.reduce(comm, buf, root=-1),
    }
    try:
        calls[call]()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
        return type(e).__name__, isinstance(e, ConfigError), str(e)
    return None


# -- what the test process expects ----------------------------------------------------------

def exact_sum(p: int, seed: int, shape, dtype: str) -> np.ndarray:
    total = sum(rank_data(seed, r, shape, "int64").astype(np.int64) for r in range(p))
    return np.asarray(total, dtype=np.int64).astype(dtype)


def assert_identical_everywhere(outs: list[np.ndarray], expected: np.ndarray, label: str) -> None:
    for rank, out in enumerate(outs):
        assert out.dtype == expected.dtype and out.shape == expected.shape, f"{label} rank {rank}"
        assert np.array_equal(out, expected), f"{label} rank {rank}: {out} != {expected}"
        assert out.tobytes() == outs[0].tobytes(), f"{label}: rank {rank} differs from rank 0"


@st.composite
def world_and_length(draw, lo: int = 1, hi: int = 8):
    p = draw(st.integers(lo, hi))
    n = draw(st.one_of(st.sampled_from(SPECIAL_LENGTHS), st.integers(0, max(p - 1, 0)),
                       st.integers(0, 3000)))
    return p, n


# -- all-reduce ----------------------------------------------------------------------------

# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_allreduce_is_the_exact_sum_on_every_rank(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(8 * BASE))
    @given(data=st.data(), algorithm=st.sampled_from(ALGORITHMS), dtype=st.sampled_from(DTYPES),
           op=st.sampled_from(("sum", "mean")), how=st.sampled_from(ALLOCS),
           seed=st.integers(0, 2**31))
    def prop(data, algorithm, dtype, op, how, seed):
        p, n = data.draw(world_and_length(sweep.lo, sweep.hi), label="p, n")
        if backend == "sim":  # a rank thread at a time: 400 examples to p = 8 were minutes;
            p = min(p, 4)  # p = 8 on sim is test_large_buffer_every_algorithm's
        if op == "mean" and dtype.startswith("int"):
            op = "sum"  # ints cannot be averaged in place (checked below)
        results = worlds(p, backend).run(job_allreduce, algorithm, dtype, n, op, how, seed)
        expected = exact_sum(p, seed, n, dtype)
        if op == "mean":
            np.divide(expected, p, out=expected)  # one correctly rounded division of the exact sum
        assert all(same for same, _, _ in results), "allreduce must work in place and return buf"
        assert_identical_everywhere([out for _, _, out in results], expected,
                                    f"{algorithm} p={p} n={n} {dtype} {op} {how}")

    prop()


# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_allreduce_of_arbitrary_floats_agrees_bitwise_across_ranks(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(2 * BASE))
    @given(data=st.data(), algorithm=st.sampled_from(ALGORITHMS),
           dtype=st.sampled_from(("float32", "float64")), how=st.sampled_from(ALLOCS),
           seed=st.integers(0, 2**31))
    def prop(data, algorithm, dtype, how, seed):
        p, n = data.draw(world_and_length(sweep.lo, sweep.hi), label="p, n")
        results = worlds(p, backend).run(
            job_allreduce, algorithm, dtype, n, "mean", how, seed, "normal"
        )
        outs = [out for _, _, out in results]
        exact = sum(rank_data(seed, r, n, dtype, "normal").astype(np.float64) for r in range(p)) / p
        tol = 1e-5 if dtype == "float32" else 1e-12
        for rank, out in enumerate(outs):
            assert out.dtype == np.dtype(dtype)
            np.testing.assert_allclose(out, exact, rtol=tol, atol=tol * p)
            assert out.tobytes() == outs[0].tobytes(), f"rank {rank} differs from rank 0 bitwise"

    prop()


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (7, 1), (0, 4), (1, 1, 1, 13)])
@pytest.mark.parametrize("how", ALLOCS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_multidimensional_contiguous_arrays_reduce_in_place(worlds, shape, how, algorithm):
    p = 3
    results = worlds(p).run(job_allreduce, algorithm, "float64", shape, "sum", how, 11)
    expected = exact_sum(p, 11, shape, "float64")
    for same, got_shape, _ in results:
        assert same and got_shape == shape
    assert_identical_everywhere([out for _, _, out in results], expected, f"{shape}")


# every p on local; other engines at p = 3 (added), the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 5, 8]), indirect=["backend"])
def test_large_buffer_every_algorithm(worlds, backend, p):
    n = 100_003
    for algorithm in ALGORITHMS:
        for how in ALLOCS:
            results = worlds(p, backend).run(job_allreduce, algorithm, "int64", n, "sum", how, p)
            assert_identical_everywhere([o for _, _, o in results], exact_sum(p, p, n, "int64"),
                                        f"{algorithm} {how}")


def test_repeated_allreduces_on_one_world_stay_correct(worlds):
    """Many calls on one world: sequence numbers, mailboxes and staging keep up."""
    p = 4
    for i in range(40):  # more messages per pair than the mailbox has slots
        algorithm, how = ALGORITHMS[i % len(ALGORITHMS)], ALLOCS[i % 2]
        results = worlds(p).run(job_allreduce, algorithm, "int32", 37 + i, "sum", how, i)
        assert_identical_everywhere([o for _, _, o in results], exact_sum(p, i, 37 + i, "int32"),
                                    f"call {i} {algorithm} {how}")


# -- reduce-scatter, all-gather, broadcast, reduce ---------------------------------------------

# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_reduce_scatter_returns_the_ranks_reduced_chunk(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(2 * BASE))
    @given(data=st.data(), algorithm=st.sampled_from(SCATTER_ALGORITHMS),
           dtype=st.sampled_from(DTYPES), how=st.sampled_from(ALLOCS), seed=st.integers(0, 2**31))
    def prop(data, algorithm, dtype, how, seed):
        p, n = data.draw(world_and_length(sweep.lo, sweep.hi), label="p, n")
        results = worlds(p, backend).run(job_reduce_scatter, algorithm, dtype, n, how, seed)
        total = exact_sum(p, seed, n, dtype)
        for rank, ((a, b), (is_view, mine)) in enumerate(zip(chunk_bounds(n, p), results)):
            assert is_view, "reduce_scatter returns a view of the rank's chunk of buf"
            assert mine.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(mine, total[a:b], err_msg=f"rank {rank}")

    prop()


# local: p in 1..8, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(1, 8), indirect=["backend"])
def test_allgather_gives_everyone_every_chunk(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(2 * BASE))
    @given(data=st.data(), algorithm=st.sampled_from(SCATTER_ALGORITHMS),
           dtype=st.sampled_from(DTYPES), how=st.sampled_from(ALLOCS), seed=st.integers(0, 2**31))
    def prop(data, algorithm, dtype, how, seed):
        p, n = data.draw(world_and_length(sweep.lo, sweep.hi), label="p, n")
        results = worlds(p, backend).run(job_allgather, algorithm, dtype, n, how, seed)
        expected = np.empty(n, dtype)
        for r, (a, b) in enumerate(chunk_bounds(n, p)):
            expected[a:b] = rank_data(seed, r, n, dtype)[a:b]
        assert all(same for same, _ in results)
        assert_identical_everywhere([out for _, out in results], expected,
                                    f"{algorithm} p={p} n={n}")

    prop()


@pytest.mark.parametrize("algorithm", ["tree", "naive"])
# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 5, 6, 8]), indirect=["backend"])
def test_broadcast_and_reduce_from_every_root(worlds, backend, algorithm, p):
    for root in range(p):
        for n, dtype, how in ((0, "int32", "shm"), (1, "float32", "numpy"), (101, "int64", "shm"),
                              (1000 + root, "float64", "numpy")):
            seed = 7 * root + n
            results = worlds(p, backend).run(
                job_rooted, "broadcast", algorithm, root, dtype, n, how, seed
            )
            assert all(same for same, _ in results)
            assert_identical_everywhere([o for _, o in results], rank_data(seed, root, n, dtype),
                                        f"broadcast root {root} n={n}")
            results = worlds(p, backend).run(
                job_rooted, "reduce", algorithm, root, dtype, n, how, seed
            )
            assert results[root][0]
            np.testing.assert_array_equal(results[root][1], exact_sum(p, seed, n, dtype),
                                          err_msg=f"reduce root {root} n={n}")


# -- misuse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    ("mean-int", "op='mean' needs a floating-point buffer"),
    ("mean-int32", "op='mean' needs a floating-point buffer"),
    ("noncontiguous", "contiguous"),
    ("noncontiguous-shm", "contiguous"),
    ("bad-op", "op must be 'sum' or 'mean'"),
    ("complex64", "complex64"),
    ("list", "numpy arrays"),
    ("list-mean", "numpy arrays"),
    ("scatter-tree", "ring, direct"),
    ("broadcast-ring", "tree, naive"),
    ("broadcast-root", "root"),
    ("reduce-root", "root"),
])
def test_misuse_raises_config_error_on_every_rank(worlds, backend, call, match):
    for name, is_config_error, message in worlds(2, backend).run(job_error, call):
        assert is_config_error, f"{call}: got {name}: {message}"
        assert match in message


def test_unknown_algorithm_lists_the_choices(worlds):
    for name, is_config_error, message in worlds(3).run(job_error, "unknown-algorithm"):
        assert is_config_error and name == "ConfigError"
        assert "butterfly" in message
        assert all(choice in message for choice in ALLREDUCE)
        assert "native" in message
