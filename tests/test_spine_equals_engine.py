"""The engine's executor (``dplab.backends.fastpath``) leaves the same bits as the spine's
(``dplab.reference.collectives``) in every buffer, for every algorithm of the registry and every
collective it runs, world sizes 1-16, integer and float buffers, in and out of shared memory;
and the engine's array builders give the readable builders' schedules, row for row.

Each example runs, on every rank, every (collective, algorithm) pair twice on the same input:
once through the spine, once through the engine, and compares the bytes there (shipping
16 ranks' buffers back would cost more than the collectives). Floats are normals, so an
addition done in another order would show in the last bit.

    pytest -q tests/test_spine_equals_engine.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplab.backends.fastpath import arrays
from dplab.backends.fastpath import executor as engine
from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference import collectives as spine
from dplab.reference.algorithms import ALGORITHMS, ALLREDUCE, ROOTED, SCATTER, SCATTER_ALGORITHMS
from dplab.reference.columns import RoundTable, columns
from dplab.reference.schedule import Schedule

DTYPES = ("float64", "float32", "float16", "int64", "int32")
LENGTHS = (0, 1, 2, 3, 5, 7, 13, 17, 31, 97, 1000, 2053)


def _calls(p: int, root: int, op: str) -> list[tuple[str, tuple]]:
    """Every (label, (function name, args)) a world of p ranks can run: the whole registry."""
    calls = [(f"allreduce({a}, {op})", ("allreduce", (a, op))) for a in ALGORITHMS]
    calls += [
        (f"{k}({a})", (k, (a,)))
        for a in SCATTER_ALGORITHMS
        for k in ("reduce_scatter", "allgather")
    ]
    calls += [
        (f"{k}({a}, root={root})", (k, (root, a))) for a in ROOTED for k in ("reduce", "broadcast")
    ]
    return calls


def job_both(
    comm, seed: int, n: int, dtype: str, how: str, kind: str, root: int, op: str
) -> list[str]:
    """On every rank: each collective through the spine, then the engine, on equal inputs; the
    labels (with the first differing index) where the bytes or the returned view differ."""
    rng = np.random.default_rng([seed, comm.rank])
    data = (rng.integers(-1000, 1001, n) if kind == "int" else rng.standard_normal(n)).astype(dtype)
    if op == "mean" and data.dtype.kind != "f":
        op = "sum"
    bad = []
    for label, (name, args) in _calls(comm.world_size, root, op):
        bufs = [comm.empty(n, dtype) if how == "shm" else np.empty(n, dtype) for _ in range(2)]
        outs = []
        for module, buf in zip((spine, engine), bufs):
            buf[...] = data
            out = getattr(module, name)(comm, buf, *args)
            outs.append(np.array(out, copy=True))
        if bufs[0].tobytes() != bufs[1].tobytes() or outs[0].tobytes() != outs[1].tobytes():
            where = np.flatnonzero(bufs[0].view(np.uint8) != bufs[1].view(np.uint8))
            bad.append(f"{label} rank {comm.rank}: first differing byte {where[:1].tolist()}")
    return bad


@st.composite
def cases(draw, p: int):
    n = draw(st.one_of(st.sampled_from(LENGTHS), st.integers(0, 3000)))
    return (draw(st.integers(0, 2**32 - 1)), n, draw(st.sampled_from(DTYPES)),
            draw(st.sampled_from(("shm", "numpy"))), draw(st.sampled_from(("normal", "int"))),
            draw(st.integers(0, p - 1)), draw(st.sampled_from(("sum", "mean"))))


def _check(world, case) -> None:
    bad = [b for rank in world.run(job_both, *case) for b in rank]
    assert not bad, f"{case}: " + "; ".join(bad[:5])


# p = 10-15 are slow: a local world each for this test alone, 2.4-5 CPU s; 1-9 and 16 stay
@pytest.mark.parametrize("p", [pytest.param(p, marks=pytest.mark.slow) if 9 < p < 16 else p
                               for p in range(1, 17)])
@settings(max_examples=3)
@given(data=st.data())
def test_the_engine_leaves_the_spines_bits_on_the_local_backend(worlds, p, data):
    _check(worlds(p), data.draw(cases(p)))


@pytest.mark.parametrize("transport", [pytest.param("mpi", marks=pytest.mark.mpi),
                                       pytest.param("torch", marks=pytest.mark.torch)])
# p = 2 and 5 are slow: the rule of tests/tiers.py (an engine keeps p = 3, 4; 5 is a world start)
@pytest.mark.parametrize("p", [pytest.param(2, marks=pytest.mark.slow), 3,
                               pytest.param(5, marks=pytest.mark.slow)])
@settings(max_examples=2)
@given(data=st.data())
def test_the_engine_leaves_the_spines_bits_on_mpi_and_torch(worlds, transport, p, data):
    try:
        check_backend(transport)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    _check(worlds(p, transport), data.draw(cases(p)))


# -- builders: the engine's array builders equal the readable ones, row for row ---------------

def _pairs(p: int) -> list[tuple[Schedule, RoundTable]]:
    """(readable, arrays) for every array builder, with a few parameters for the parametric ones."""
    params = {"pipelined_ring": (1, 2, 5) + ((16,) if p % 16 == 1 or p < 5 else ()),
              "hierarchical": (1, 2, 3, 4, 5, 8, 64)}
    out = [(ALLREDUCE[name](p, *args), fast(p, *args)) for name, fast in arrays.ALLREDUCE.items()
           for args in ([(x,) for x in params[name]] if name in params else [()])]
    out += [
        (SCATTER[name][i](p), fast[i](p)) for name, fast in arrays.SCATTER.items() for i in (0, 1)
    ]
    return out


# small p, 2^k and neighbours
@pytest.mark.parametrize("p", [*range(1, 21), 24, 31, 32, 33, 48, 64])
def test_the_array_builders_equal_the_readable_builders(p):
    """Same rounds, same transfers, same order within each round (the order messages post in)."""
    for want, got in _pairs(p):
        assert got.equals(columns(want)), (want.name, p)  # name, sizes, and every column
        if p <= 8:
            assert tuple(map(got.transfers, range(len(got)))) == want.rounds


def test_every_array_builder_is_one_of_the_registry():
    assert set(arrays.ALLREDUCE) <= set(ALLREDUCE) and set(arrays.SCATTER) <= set(SCATTER)
