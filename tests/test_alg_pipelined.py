"""Pipelined tree and ring (``dplab.reference.algorithms.pipelined``): NCCL's binary tree, every
contribution exactly once for p = 1..64 and several piece counts, the rounds and the bytes per rank
against their closed forms, and the name ``"pipelined_tree:k"`` through the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dplab.reference.algorithms import ALLREDUCE, PARAMETRIC, allreduce_schedule
from dplab.reference.algorithms import pipelined as P
from dplab.reference.algorithms import ring as ring_mod
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError
from dplab.reference.simulate import is_allreduce, simulate

PIECES = (1, 2, 3, 8)


def nccl_get_btree(nranks: int, rank: int) -> tuple[int, int, int]:
    """ncclGetBtree (src/graph/trees.cc), line for line: (up, down0, down1), -1 for none."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1)
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


@pytest.mark.parametrize("p", range(1, 65))
def test_btree_is_nccls_and_as_deep_as_lg_p(p):
    parents, kids = P.btree(p), P.children_of(P.btree(p))
    for r in range(p):
        up, d0, d1 = nccl_get_btree(p, r)
        assert parents[r] == up and kids[r] == sorted(c for c in (d0, d1) if c >= 0), r
        assert len(kids[r]) <= 2 and (r % 2 == 0 or not kids[r])  # odd ranks are leaves
    assert max(P.heights(parents)) == lg(p)
    assert P.depths(parents) == [
        0 if r == 0 else 1 + P.depths(parents)[parents[r]] for r in range(p)
    ]


# p = 34-62 are slow: their provenance costs 0.2-1.8 CPU s each; 1-33, 63 and 64 stay by default
@pytest.mark.parametrize("p", [pytest.param(p, marks=pytest.mark.slow) if 33 < p < 63 else p
                               for p in range(1, 65)])
def test_every_contribution_exactly_once_with_the_closed_form_rounds(p):
    for k in PIECES:
        tree, ring = P.pipelined_tree(p, k), P.pipelined_ring(p, k)
        assert (tree.num_chunks, ring.num_chunks) == (k, p * k)
        assert is_allreduce(simulate(tree)), k
        if k == 2 or p <= 16:
            # the ring's provenance is p^2 k numbers per round: keep the suite fast
            assert is_allreduce(simulate(ring)), k
        # not 2 lg p * k, not 2(lg p + k - 1)
        assert len(tree.rounds) == (2 * lg(p) + k - 1 if p > 1 else 0)
        assert len(ring.rounds) == (2 * (p - 1) + k - 1 if p > 1 else 0)
    # one slice is the plain ring (its rounds grouped by chunk)
    assert [set(r) for r in P.pipelined_ring(p, 1).rounds] == [
        set(r) for r in ring_mod.allreduce(p).rounds
    ]


@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_values_sum_for_awkward_lengths(p):
    rng = np.random.default_rng(p)
    for k in (1, 3, 8):
        for n in (0, 1, k - 1, k, p * k + 1, 97):
            bufs = [rng.integers(-10**9, 10**9, size=n) for _ in range(p)]
            total = np.sum(bufs, axis=0, dtype=np.int64)
            for s in (P.pipelined_tree(p, k), P.pipelined_ring(p, k)):
                assert all(np.array_equal(b, total) for b in simulate(s, bufs).buffers), (
                    s.name,
                    k,
                    n,
                )


def test_pieces_flow_one_round_behind_each_other():
    """p = 4: rank 1 sends piece j up in round j; rank 0 sends piece j down in round H + j = 2 +
    j."""
    s = P.pipelined_tree(4, 3)
    up = [(i, t.chunk) for i, rnd in enumerate(s.rounds) for t in rnd if (t.src, t.dst) == (1, 2)]
    down = [(i, t.chunk) for i, rnd in enumerate(s.rounds) for t in rnd if (t.src, t.dst) == (0, 2)]
    assert up == [(0, 0), (1, 1), (2, 2)] and down == [(2, 0), (3, 1), (4, 2)]
    ring = P.pipelined_ring(3, 2)  # slice j of ring step s goes in round s + j
    sent = [(i, t.chunk) for i, rnd in enumerate(ring.rounds) for t in rnd if t.src == 0]
    assert sent == [(0, 4), (1, 2), (1, 5), (2, 0), (2, 3), (3, 1), (3, 4), (4, 5)]


@pytest.mark.parametrize("p", range(1, 20))
def test_bytes_per_rank_closed_forms(p):
    """Tree: n up, n to each child: 3n from p = 4 on (p = 2: n, p = 3: 2n), whatever k. Ring: the
    ring's 2(p-1)/p n when pk divides n; exactly 2n minus the two smallest ring chunks otherwise."""
    for k in PIECES:
        for n in (0, 1, 7, p * k, 12 * p * k, 12 * p * k + 5):
            assert cost(P.pipelined_tree(p, k), n, 0, 0, 0).bytes_sent_max == P.tree_busiest(p, n)
            assert cost(P.pipelined_ring(p, k), n, 0, 0, 0).bytes_sent_max == P.ring_busiest(
                p, n, k
            )
        n = 12 * p * k
        assert P.tree_busiest(p, n) == n * min(p - 1, 3)
        assert P.ring_busiest(p, n, k) == 2 * (p - 1) * n // p


def test_registry_names_defaults_and_bad_pieces():
    assert (
        ALLREDUCE["pipelined_tree"] is P.pipelined_tree
        and ALLREDUCE["pipelined_ring"] is P.pipelined_ring
    )
    assert PARAMETRIC["pipelined_tree"] == P.TREE_PIECES == 8
    assert PARAMETRIC["pipelined_ring"] == P.RING_SLICES
    assert allreduce_schedule("pipelined_tree", 5).num_chunks == 8
    assert allreduce_schedule("pipelined_tree:3", 5).num_chunks == 3
    assert allreduce_schedule("pipelined_ring:2", 5).num_chunks == 10
    with pytest.raises(ConfigError, match="must be >= 1"):
        allreduce_schedule("pipelined_ring:0", 4)
    with pytest.raises(ConfigError, match="pipelined_tree:4"):
        P.pipelined_tree(4, 0)
