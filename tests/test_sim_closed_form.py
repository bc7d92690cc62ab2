"""Validation (d): on a cluster without contention the simulator and the cost model agree exactly.

The cost model prices a round as the slowest rank's slowest port (alpha + m beta per message, for
the larger of what it sends and receives there) plus gamma per reduced byte, summed over rounds.
The simulator runs the same schedule message by message, each rank on its own clock, each transfer
holding its two ports. Where every rank has its own port on each link, the two give the same
seconds to float rounding (1e-12 relative) for chunks of one size: ring, direct, naive, recursive
doubling, Rabenseifner, tree and hierarchical, on one node and on two levels. Where ports are
shared (one NIC per node), the simulator's queues cost more than the cost model's contention-free
price; double_tree's interleaved trees cost more too (a greedy port schedule, not the round's ideal
one).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from dplab.backends.launch.world import launch
from dplab.backends.sim.timing import collective_time
from dplab.reference import collectives
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.cluster import cluster
from dplab.reference.costmodel import closed_form, cost
from dplab.reference.topology import Topology

EXACT = ("ring", "direct", "naive", "recursive_doubling", "rabenseifner", "tree", "hierarchical:8")


def _model(c, p: int, algorithm: str, nbytes: int) -> float:
    return cost(allreduce_schedule(algorithm, p), nbytes, itemsize=4, topology=Topology.of(c)).time


@pytest.mark.parametrize(
    "name,p", [("dgx-h100", 8), ("dgx-h100x2", 16), ("dgx-h100x3", 24)]  # one node, two levels
)
@pytest.mark.parametrize("algorithm", EXACT)
def test_the_simulator_equals_the_cost_model_without_contention(name, p, algorithm):
    c = cluster(name)
    even = 4 * p * 1000
    sim = collective_time(c, p, algorithm, even).seconds
    assert math.isclose(sim, _model(c, p, algorithm, even), rel_tol=1e-12), algorithm
    # Uneven chunks: each round's slowest rank differs, and the ranks' own clocks let a fast round
    # start before the slowest rank of the last one is done, so the cost model, which ends every
    # round with its slowest rank, is an upper bound (a few parts in a million here). Except for
    # direct, whose p - 1 messages per port differ in length: a transfer holds both of its ports at
    # once, and the rotation that makes each step a permutation no longer lines up (up to 15% more).
    uneven = 4 * 1003 * p + 12
    sim, model = collective_time(c, p, algorithm, uneven).seconds, _model(c, p, algorithm, uneven)
    low, high = (1 - 1e-4, 1 + 1e-12) if algorithm != "direct" else (1 - 1e-12, 1.15)
    assert model * low <= sim <= model * high, (algorithm, sim / model - 1)


def test_the_simulator_equals_the_textbook_formulas_on_one_level():
    c = cluster("dgx-h100")
    link = c.intra
    for algorithm in ("ring", "direct", "naive", "recursive_doubling", "rabenseifner"):
        for p in (2, 4, 8):
            n = 4 * 1024 * p
            want = closed_form(algorithm, p, n, link.alpha, link.beta, c.gamma)
            assert math.isclose(collective_time(c, p, algorithm, n).seconds, want, rel_tol=1e-12)


def _timed(comm, algorithm: str, n: int) -> float:
    x = np.arange(n, dtype=np.float32) + comm.rank
    t0 = comm.now()
    collectives.allreduce(comm, x, algorithm=algorithm)
    return comm.now() - t0


def test_rank_threads_with_real_data_take_the_same_time_as_the_schedule_alone():
    c, n = cluster("dgx-h100x2"), 10007  # uneven chunks: every port decision matters
    for algorithm in ("ring", "direct", "rabenseifner", "double_tree", "pipelined_ring"):
        threads = max(launch(_timed, 10, backend="sim", cluster=c, args=(algorithm, n)))
        assert threads == collective_time(c, 10, algorithm, 4 * n).seconds, algorithm


def test_a_shared_port_queues_what_the_cost_model_prices_as_free():
    c = cluster("dgx-h100x2")
    shared = replace(c, inter=replace(c.inter, ranks_per_port=8))  # one NIC per node, not per GPU
    nbytes = 64 << 20
    alone, queued = (collective_time(x, 16, "direct", nbytes).seconds for x in (c, shared))
    assert math.isclose(alone, _model(c, 16, "direct", nbytes), rel_tol=1e-12)
    assert queued > 4 * alone  # eight ranks' inter-node messages wait in one queue
    assert _model(shared, 16, "direct", nbytes) == _model(
        c, 16, "direct", nbytes
    )  # the model cannot tell
