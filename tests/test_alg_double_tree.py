"""NCCL's double binary tree (``dplab.reference.algorithms.double_tree``): every rank a leaf in at
least one tree and interior in at most one for p = 1..64, NCCL's trees where we follow them (even
p) and why we do not (odd p), every contribution exactly once, rounds and bytes in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_alg_pipelined import nccl_get_btree

from dplab.reference.algorithms import ALLREDUCE, PARAMETRIC, allreduce_schedule
from dplab.reference.algorithms import double_tree as D
from dplab.reference.algorithms import pipelined as P
from dplab.reference.algorithms import ring as ring_mod
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError
from dplab.reference.simulate import is_allreduce, simulate


def nccl_get_dtree(nranks: int, rank: int) -> tuple[int, int]:
    """ncclGetDtree (src/graph/trees.cc) for the parents only: (tree 0's, tree 1's)."""
    s0 = nccl_get_btree(nranks, rank)[0]
    if nranks % 2 == 1:
        u = nccl_get_btree(nranks, (rank - 1 + nranks) % nranks)[0]
        return s0, -1 if u == -1 else (u + 1) % nranks
    u = nccl_get_btree(nranks, nranks - 1 - rank)[0]
    return s0, -1 if u == -1 else nranks - 1 - u


def height(p: int) -> int:
    """The trees' height: ceil(lg p) for even p, ceil(lg(p - 1)) for odd p (rank p-1 hangs at depth
    1)."""
    q = p if p % 2 == 0 else p - 1
    return max(math.ceil(math.log2(q)) if q > 1 else 0, 1 if p > 1 else 0)


@pytest.mark.parametrize("p", range(1, 65))
def test_every_rank_is_a_leaf_somewhere_and_interior_at_most_once(p):
    roles = D.roles(p)
    assert all("leaf" in r for r in roles), [r for r in range(p) if "leaf" not in roles[r]]
    for parents in D.trees(p):
        kids = P.children_of(parents)
        assert parents.count(-1) == 1 and all(len(c) <= 2 for c in kids)
        # a spanning tree: every rank but the root has a parent
        assert sum(len(c) for c in kids) == p - 1
        assert max(P.heights(parents)) == height(p)


@pytest.mark.parametrize("p", range(1, 65))
def test_nccls_trees_where_we_follow_them_and_why_not_for_odd_p(p):
    assert D.nccl_dtree(p) == tuple([nccl_get_dtree(p, r)[w] for r in range(p)] for w in (0, 1))
    if p % 2 == 0 or p == 1:
        assert D.trees(p) == D.nccl_dtree(p)
        return
    t0, t1 = (P.children_of(t) for t in D.nccl_dtree(p))
    assert t0[0] and t1[0], "NCCL's odd shift leaves rank 0 interior in both trees"
    ours0, ours1 = D.trees(p)
    even0, even1 = D.nccl_dtree(p - 1)
    assert ours0[:-1] == even0 and ours1[:-1] == even1  # NCCL's even double tree over p - 1 ranks
    assert (ours0[-1], ours1[-1]) == (0, p - 2)  # and rank p - 1 under both roots
    assert D.roles(p)[p - 1] == ("leaf", "leaf")


@pytest.mark.parametrize("p", range(1, 65))
def test_every_contribution_exactly_once_in_closed_form_rounds(p):
    for k in (1, 2, 3, 8):
        s = D.allreduce(p, k)
        assert s.num_chunks == 2 * k and is_allreduce(simulate(s)), k
        assert len(s.rounds) == (2 * height(p) + k - 1 if p > 1 else 0)
        halves = [{t.chunk for rnd in D.one_tree(p, w, k).rounds for t in rnd} for w in (0, 1)]
        assert halves == ([set(range(k)), set(range(k, 2 * k))] if p > 1 else [set(), set()])


@pytest.mark.parametrize("p", [2, 3, 6, 7, 16])
def test_values_sum_for_awkward_lengths(p):
    rng = np.random.default_rng(p)
    for k in (1, 3, 8):
        for n in (0, 1, 2 * k - 1, 2 * k + 1, 101):
            bufs = [rng.integers(-10**9, 10**9, size=n) for _ in range(p)]
            total = np.sum(bufs, axis=0, dtype=np.int64)
            assert all(
                np.array_equal(b, total) for b in simulate(D.allreduce(p, k), bufs).buffers
            ), (k, n)


@pytest.mark.parametrize("p", range(1, 34))
def test_bytes_per_rank_closed_form(p):
    """2n when 2k divides n (p >= 4: interior in one tree 3 n/2, leaf in the other n/2), any n
    exactly."""
    for k in (1, 2, 5, 8):
        for n in (0, 1, 2 * k - 1, 2 * k * 7, 2 * k * 7 + 3):
            assert cost(D.allreduce(p, k), n, 0, 0, 0).bytes_sent_max == D.busiest(p, n, k), (k, n)
            assert cost(D.allreduce(p, k), n, 0, 0, 0).bytes_recv_max == D.busiest(p, n, k), (k, n)
        assert D.busiest(p, 14 * k, k) == 14 * k * (0, 0, 1, 1.5, 2)[min(p, 4)]


def test_time_is_bounded_by_four_messages_each_way_per_round_and_the_docstring_numbers():
    for p in (2, 3, 4, 7, 8, 16, 33):
        for k in (1, 2, 4, 16):
            n = 2 * k * 1000
            rounds = 2 * height(p) + k - 1
            for a, b, g in ((1, 0, 0), (0, 1, 0), (0, 0, 1), (5e-6, 1e-10, 5e-11)):
                bound = rounds * (4 * a + 2 * b * n / k + g * n / k)
                assert cost(D.allreduce(p, k), n, a, b, g).time <= bound * (1 + 1e-12), (
                    p,
                    k,
                    a,
                    b,
                    g,
                )
    abg, n = (5e-6, 1 / 10e9, 1 / 20e9), 16 << 20  # the docstring: best k, 16 MiB, float32
    for p, ratio in ((8, 1.3), (256, 0.86)):
        best = min(cost(D.allreduce(p, k), n, *abg, 4).time for k in (1, 2, 4, 8, 16, 32, 64))
        assert (
            round(best / cost(ring_mod.allreduce(p), n, *abg, 4).time, 2 if ratio < 1 else 1)
            == ratio
        )


def test_registry_and_bad_arguments():
    assert ALLREDUCE["double_tree"] is D.allreduce and PARAMETRIC["double_tree"] == P.TREE_PIECES
    assert allreduce_schedule("double_tree", 6).num_chunks == 2 * P.TREE_PIECES
    assert allreduce_schedule("double_tree:3", 6).num_chunks == 6
    with pytest.raises(ConfigError, match="double_tree:4"):
        D.allreduce(4, 0)
    with pytest.raises(ConfigError, match="trees 0 and 1"):
        D.one_tree(4, 2)
