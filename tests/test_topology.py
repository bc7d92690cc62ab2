"""The cost model on a topology: one port per kind of link, flat as the one-level case, and the
vectorised walk equal to a plain walk over the Transfer objects for every registered algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule
from dplab.reference.costmodel import cost, curve
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, Transfer, chunk_bounds, messages
from dplab.reference.topology import PRESETS, Link, Topology


def walk(s: Schedule, nbytes: int, topo: Topology, itemsize: int = 1) -> float:
    """The model as the module docstring states it, one Transfer at a time (the oracle)."""
    p, g = s.world_size, min(topo.ranks_per_node, s.world_size)
    cb = [(b - a) * itemsize for a, b in chunk_bounds(nbytes // itemsize, s.num_chunks)]
    total = 0.0
    for rnd in s.rounds:
        # msgs out, in, bytes out, in
        port = {(r, L): [0, 0, 0, 0] for r in range(p) for L in (0, 1)}
        red = [0] * p
        for m in messages(rnd):
            L = int(m.src // g != m.dst // g)
            port[m.src, L][0] += 1
            port[m.dst, L][1] += 1
        for t in rnd:
            L = int(t.src // g != t.dst // g)
            port[t.src, L][2] += cb[t.chunk]
            port[t.dst, L][3] += cb[t.chunk]
            red[t.dst] += cb[t.chunk] if t.op == "reduce" else 0
        links = (topo.intra, topo.inter)
        total += max(max(links[L].alpha * max(port[r, L][:2]) + links[L].beta * max(port[r, L][2:])
                         for L in (0, 1)) + topo.gamma * red[r] for r in range(p)) if rnd else 0.0
    return total


TOPOLOGIES = [PRESETS["dgx-h100"], Topology("t3", 3, Link(1e-6, 1e-10), Link(7e-6, 3e-9), 2e-11),
              Topology.flat(5e-6, 1e-9, 1e-10)]


@given(alg=st.sampled_from(sorted(ALLREDUCE)), p=st.integers(1, 12), n=st.integers(0, 5000),
       topo=st.sampled_from(TOPOLOGIES), itemsize=st.sampled_from([1, 4]))
def test_vectorised_cost_equals_the_plain_walk(alg, p, n, topo, itemsize):
    s = allreduce_schedule(alg, p)
    got = cost(s, n, topology=topo, itemsize=itemsize).time
    assert math.isclose(got, walk(s, n, topo, itemsize), rel_tol=1e-9, abs_tol=1e-18), (alg, p, n)


@pytest.mark.parametrize("alg", ["ring", "tree", "hierarchical:2", "direct"])
def test_flat_topology_is_the_one_level_model(alg):
    s = allreduce_schedule(alg, 6)
    for n in (0, 7, 6000, 1 << 20):
        flat = cost(s, n, 3e-6, 2e-9, 1e-10, 4)
        assert flat == cost(s, n, topology=Topology.flat(3e-6, 2e-9, 1e-10), itemsize=4)
        # one node holding every rank: every message on the intra link, priced the same way
        one_node = Topology("node", 64, Link(3e-6, 2e-9), Link(1.0, 1.0), 1e-10)
        assert math.isclose(
            cost(s, n, topology=one_node, itemsize=4).time, flat.time, rel_tol=1e-12
        )


def test_a_rank_using_both_links_in_one_round_pays_the_slower_port_not_the_sum():
    topo = Topology("t", 2, Link(1.0, 0.01), Link(10.0, 0.1), 0.0)
    both = Schedule("both", 4, 1, ((Transfer(0, 1, 0, "copy"), Transfer(0, 2, 0, "copy")),))
    assert cost(both, 100, topology=topo).time == max(1.0 + 1.0, 10.0 + 10.0)  # ports in parallel
    two_across = Schedule("two", 4, 1, ((Transfer(0, 2, 0, "copy"), Transfer(0, 3, 0, "copy")),))
    assert cost(two_across, 100, topology=topo).time == 2 * 10.0 + 0.1 * 200  # one port: in series
    two_inside = Schedule("in", 4, 1, ((Transfer(0, 1, 0, "copy"), Transfer(2, 3, 0, "copy")),))
    assert cost(two_inside, 100, topology=topo).time == 1.0 + 1.0  # different ranks: at once


def test_consecutive_chunks_to_one_peer_are_one_message():
    rnd = (Transfer(0, 1, 0, "copy"), Transfer(0, 1, 1, "copy"), Transfer(0, 1, 3, "copy"))
    s = Schedule("x", 2, 4, (rnd,))
    c = cost(s, 400, 1.0, 0.0, 0.0)
    assert c.time == 2.0  # chunks 0-1 one message, chunk 3 another


def test_curve_is_cost_where_chunks_divide_and_the_next_multiple_elsewhere():
    topo = PRESETS["dgx-h100"]
    for alg, p in (("ring", 24), ("hierarchical:8", 24), ("tree", 24), ("direct", 9)):
        s = allreduce_schedule(alg, p)
        k = s.num_chunks
        sizes = np.array([0, 4 * k, 4 * k * 1000, 4 * (k * 1000 + 1), 4 * 3], dtype=np.int64)
        got = curve(s, sizes, topo, 4)
        want = [
            cost(s, int(-(-n // 4 // k) * k * 4), topology=topo, itemsize=4).time for n in sizes
        ]
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert cost(s, int(sizes[3]), topology=topo, itemsize=4).time <= got[3]


def test_hierarchical_beats_the_ring_across_nodes_and_the_errors_say_what_to_do():
    topo = PRESETS["dgx-h100"]
    ring, hier = allreduce_schedule("ring", 64), allreduce_schedule("hierarchical:8", 64)
    for n in (1 << 10, 1 << 20, 1 << 30):
        assert (
            cost(hier, n, topology=topo, itemsize=4).time
            < cost(ring, n, topology=topo, itemsize=4).time
        )
    with pytest.raises(ConfigError, match="not both"):
        cost(ring, 8, 1.0, 1.0, 1.0, topology=topo)
    with pytest.raises(ConfigError, match="alpha, beta and gamma"):
        cost(ring, 8)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        Topology("bad", 0, Link(1, 1), Link(1, 1), 0)
    assert all(t.source for t in PRESETS.values())
