"""The cost model's walk over a schedule agrees with the closed forms from the literature."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.costmodel import Cost, closed_form, cost

ALPHA = st.floats(0, 1e-3, allow_subnormal=False)  # seconds per message
BETA = st.floats(0, 1e-8, allow_subnormal=False)  # seconds per byte
GAMMA = st.floats(0, 1e-9, allow_subnormal=False)  # seconds per reduced byte
POWERS_OF_TWO = st.sampled_from([1, 2, 4, 8, 16, 32, 64])


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-18)


@given(p=st.integers(1, 64), per_rank=st.integers(0, 10_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_ring_walk_equals_closed_form(p, per_rank, alpha, beta, gamma):
    n = p * per_rank
    c = cost(allreduce_schedule("ring", p), n, alpha, beta, gamma)
    assert close(c.time, closed_form("ring", p, n, alpha, beta, gamma))
    assert c.rounds == 2 * (p - 1)
    assert c.bytes_sent_max == c.bytes_recv_max == 2 * (p - 1) * n // p


@given(p=st.integers(1, 64), n=st.integers(0, 100_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_naive_walk_equals_closed_form_for_any_n(p, n, alpha, beta, gamma):
    c = cost(allreduce_schedule("naive", p), n, alpha, beta, gamma)
    assert close(c.time, closed_form("naive", p, n, alpha, beta, gamma))
    assert c.rounds == (2 if p > 1 else 0)
    assert c.bytes_sent_max == c.bytes_recv_max == (p - 1) * n  # all through the root


@given(p=POWERS_OF_TWO, n=st.integers(0, 100_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_tree_walk_equals_closed_form_for_powers_of_two(p, n, alpha, beta, gamma):
    c = cost(allreduce_schedule("tree", p), n, alpha, beta, gamma)
    assert close(c.time, closed_form("tree", p, n, alpha, beta, gamma))
    lg = p.bit_length() - 1
    assert c.rounds == 2 * lg
    assert c.bytes_sent_max == lg * n  # the root sends the whole buffer in every broadcast round


@given(p=st.integers(1, 100), n=st.integers(0, 100_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_tree_for_any_p_is_priced_with_ceil_lg_p_rounds(p, n, alpha, beta, gamma):
    lg = math.ceil(math.log2(p))
    c = cost(allreduce_schedule("tree", p), n, alpha, beta, gamma)
    assert c.rounds == 2 * lg
    # every tree round moves one whole buffer along the critical path, so the walk is the
    # closed form with ceil(lg p) for any p, not only powers of two
    assert close(c.time, 2 * lg * alpha + 2 * lg * n * beta + lg * n * gamma)
    assert close(c.time, closed_form("tree", p, n, alpha, beta, gamma))


@given(p=st.integers(1, 32), per_rank=st.integers(0, 5_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_direct_walk_equals_closed_form(p, per_rank, alpha, beta, gamma):
    n = p * per_rank
    c = cost(allreduce_schedule("direct", p), n, alpha, beta, gamma)
    assert close(c.time, closed_form("direct", p, n, alpha, beta, gamma))
    assert c.rounds == (2 if p > 1 else 0)
    assert c.bytes_sent_max == c.bytes_recv_max == 2 * (p - 1) * n // p


@given(p=st.integers(2, 64), n=st.integers(0, 100_000), alpha=ALPHA, beta=BETA, gamma=GAMMA)
def test_ring_with_uneven_chunks_is_bounded_by_the_closed_forms(p, n, alpha, beta, gamma):
    """n not divisible by p: every round waits for its largest chunk, ceil(n / p)."""
    c = cost(allreduce_schedule("ring", p), n, alpha, beta, gamma)
    lower = closed_form("ring", p, n, alpha, beta, gamma)
    upper = closed_form("ring", p, -(-n // p) * p, alpha, beta, gamma)
    assert lower * (1 - 1e-9) - 1e-18 <= c.time <= upper * (1 + 1e-9) + 1e-18
    assert 2 * (p - 1) * (n // p) <= c.bytes_sent_max <= 2 * (p - 1) * -(-n // p)


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 16])
def test_ring_bytes_sent_is_2_p_minus_1_over_p_n(p):
    n = 840 * 16  # divisible by every p above
    c = cost(allreduce_schedule("ring", p), n, 1.0, 1.0, 1.0)
    assert c.bytes_sent_max * p == 2 * (p - 1) * n
    assert c == Cost(c.time, 2 * (p - 1), 2 * (p - 1) * n // p, 2 * (p - 1) * n // p)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "direct"])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13])
def test_each_term_separately(algorithm, p):
    """alpha alone counts messages on the critical path; beta alone, bytes;
    gamma alone, reductions."""
    s = allreduce_schedule(algorithm, p)
    n = 13 * 8 * 5 * 3 * 2 * 1000  # divisible by every p here
    for a, b, g in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
        assert close(cost(s, n, a, b, g).time, closed_form(algorithm, p, n, a, b, g))
    if p == 1:
        assert cost(s, n, 1.0, 1.0, 1.0) == Cost(0.0, 0, 0, 0)


def test_itemsize_cuts_chunks_at_whole_elements():
    s = allreduce_schedule("ring", 4)
    # 10 float64 = 80 bytes: chunks of 3, 3, 2, 2 elements = 24, 24, 16, 16 bytes
    c = cost(s, 80, 0.0, 1.0, 0.0, itemsize=8)
    assert c.time == 6 * 24  # every round waits for a 24-byte chunk
    # rank 2 sends chunks 1, 0, 3 (reduce-scatter) then 2, 1, 0 (all-gather): 64 + 64 bytes
    assert c.bytes_sent_max == c.bytes_recv_max == 128
    # by bytes instead, 80 / 4 = 20 bytes per chunk
    assert cost(s, 80, 0.0, 1.0, 0.0).time == 6 * 20


def test_ring_beats_tree_for_large_buffers_and_loses_for_small_ones():
    p, alpha, beta, gamma = 16, 5e-6, 1e-10, 1e-11
    ring, tree = allreduce_schedule("ring", p), allreduce_schedule("tree", p)
    assert cost(ring, 8, alpha, beta, gamma).time > cost(tree, 8, alpha, beta, gamma).time
    big = 1 << 28
    assert cost(ring, big, alpha, beta, gamma).time < cost(tree, big, alpha, beta, gamma).time


def test_closed_form_of_one_rank_is_free_and_unknown_names_are_rejected():
    assert all(
        closed_form(a, 1, 1e6, 1.0, 1.0, 1.0) == 0.0 for a in ("ring", "tree", "naive", "direct")
    )
    with pytest.raises(ValueError, match="butterfly"):
        closed_form("butterfly", 4, 100, 1.0, 1.0, 1.0)
