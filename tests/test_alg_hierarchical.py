"""Hierarchical all-reduce: the schedule, its bytes per link, every backend, and training."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from tiers import engines

from dplab.reference import collectives
from dplab.reference.algorithms import PARAMETRIC, allreduce_schedule, hierarchical, ring
from dplab.reference.columns import columns
from dplab.reference.costmodel import cost
from dplab.reference.pictures import render_rounds
from dplab.reference.simulate import is_allreduce, simulate
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

NODE_SIZES = (2, 3, 5, 8)  # g = 1 and g >= p are the ring (tested below)


# p = 34-62 are slow, as in test_alg_pipelined.py: their provenance costs most of the sweep's CPU
@pytest.mark.parametrize("p", [pytest.param(p, marks=pytest.mark.slow) if 33 < p < 63 else p
                               for p in range(1, 65)])
def test_every_contribution_counted_once_in_two_rings_inside_and_two_across(p):
    for g in NODE_SIZES:
        s = hierarchical.allreduce(p, g)
        assert is_allreduce(simulate(s)), (p, g)
        ge, nodes, _ = hierarchical.layout(p, g)
        assert len(s.rounds) == 2 * (ge - 1) + 2 * (nodes - 1), (p, g)
        assert s.num_chunks == ge * nodes


def test_hierarchical_values_sum_exactly_for_uneven_nodes():
    rng = np.random.default_rng(0)
    for p, g in ((5, 2), (7, 3), (12, 5)):
        for n in (0, 1, 3, 37):
            bufs = [rng.integers(-10**9, 10**9, size=n) for _ in range(p)]
            total = np.sum(bufs, axis=0, dtype=np.int64)
            assert all(
                np.array_equal(b, total)
                for b in simulate(hierarchical.allreduce(p, g), bufs).buffers
            )


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 8, 13])
def test_one_rank_per_node_and_one_node_are_the_ring(p):
    assert hierarchical.allreduce(p, 1).rounds == ring.allreduce(p).rounds
    assert hierarchical.allreduce(p, p).rounds == ring.allreduce(p).rounds
    assert hierarchical.allreduce(p, 2 * p).rounds == ring.allreduce(p).rounds


def _bytes_across(s, g, n):
    """Per rank: bytes sent to another node, for n bytes cut into the schedule's chunks
    (divisible)."""
    t, b = columns(s), n // s.num_chunks
    across = (t.src // g) != (t.dst // g)
    return np.bincount(t.src[across].astype(int), minlength=s.world_size) * b


@pytest.mark.parametrize("p,g", [(4, 2), (8, 2), (8, 4), (12, 4), (16, 8), (64, 8)])
def test_bytes_per_rank_are_the_rings_and_only_a_gth_crosses_nodes(p, g):
    n = p * 1024  # whole chunks
    c = cost(hierarchical.allreduce(p, g), n, 0.0, 1.0, 0.0)
    assert c.bytes_sent_max == c.bytes_recv_max == 2 * (p - 1) * n // p
    nodes = p // g
    across = _bytes_across(hierarchical.allreduce(p, g), g, n)
    assert (across == 2 * (nodes - 1) * n // (nodes * g)).all()  # every rank, its own NIC
    ring_across = _bytes_across(ring.allreduce(p), g, n)
    # the ring pushes everything through one link per node
    assert ring_across.max() == 2 * (p - 1) * n // p


def test_a_smaller_last_node_runs_several_rings_and_still_sums():
    s = hierarchical.allreduce(5, 2)  # nodes {0, 1} {2, 3} {4}: rank 4 holds both pieces
    assert s.num_chunks == 6
    inter = s.rounds[1]  # the first round across nodes
    # node 2 is ring position x = 2 of N = 3: it sends sub-chunk (x - 1) mod N = 1 of both pieces
    assert sorted(t.chunk for t in inter if t.src == 4) == [0 * 3 + 1, 1 * 3 + 1]
    assert is_allreduce(simulate(s))


def test_the_name_takes_the_node_size_and_defaults():
    assert PARAMETRIC["hierarchical"] == hierarchical.NODE_SIZE
    assert allreduce_schedule("hierarchical", 6) == hierarchical.allreduce(
        6, hierarchical.NODE_SIZE
    )
    assert allreduce_schedule("hierarchical:3", 6) == hierarchical.allreduce(6, 3)


def test_docstring_picture_is_the_rendering():
    picture = textwrap.indent(render_rounds(hierarchical.allreduce(4, 2)), "    ")
    assert picture in hierarchical.__doc__, f"paste this into hierarchical.py:\n{picture}"


# -- every backend ---------------------------------------------------------------------------

def job_allreduce(comm, algorithm, n, dtype):
    buf = np.empty(n, dtype)
    buf[...] = (np.arange(n) % 1000 - 500) * (comm.rank + 1)
    collectives.allreduce(comm, buf, algorithm=algorithm)
    return buf


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3, 5]), indirect=["backend"])
def test_hierarchical_sums_exactly_on_every_backend(worlds, backend, p):
    for algorithm in ("hierarchical", "hierarchical:3"):
        for n, dtype in ((0, "float64"), (1, "int32"), (7, "float32"), (4099, "int64")):
            results = worlds(p, backend).run(job_allreduce, algorithm, n, dtype)
            want = ((np.arange(n) % 1000 - 500) * (p * (p + 1) // 2)).astype(dtype)
            for rank, out in enumerate(results):
                np.testing.assert_array_equal(out, want, err_msg=f"{backend} {algorithm} p={p} "
                                                                 f"n={n} r{rank}")


def _train(comm, cfg, sync):
    return train_sync(comm, cfg, sync)


@pytest.mark.parametrize("p", [3, 4])
def test_train_sync_with_hierarchical_equals_train_single(worlds, backend, p):
    from dplab.reference.model import MLPConfig
    from dplab.reference.optim import OptimConfig

    cfg = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                      global_batch=11, steps=3, seed=3, optimizer=OptimConfig("adam", lr=0.01))
    ref = train_single(cfg)
    results = worlds(p, backend).run(_train, cfg, SyncConfig("hierarchical:2", 1e-6))
    err = np.max(np.abs(results[0].params - ref.params)) / max(1.0, np.max(np.abs(ref.params)))
    assert err <= 1e-10, err
    assert all(np.array_equal(r.params, results[0].params) for r in results)
