"""What pipelining buys in the cost model, and what it does not: the pipelined tree's time in
closed form (p a power of two, k >= lg p), the pipelined ring at exactly the ring's time plus
2(p-1)(k-1) alpha, and ``sliced_ring_time``, the real effect (gamma hidden behind the wire)."""

from __future__ import annotations

import math

import pytest

from dplab.reference.algorithms import pipelined as P
from dplab.reference.algorithms import ring as ring_mod
from dplab.reference.algorithms import tree as tree_mod
from dplab.reference.costmodel import cost

ABG = (5e-6, 1 / 10e9, 1 / 20e9)  # 5 us, 10 GB/s links, 20 GB/s reductions


@pytest.mark.parametrize("p", [4, 8, 16, 32, 64])
def test_pipelined_tree_time_closed_form(p):
    """Term by term, k >= 3: (3k + 4H - 3) alpha, (3k + 4H - 3) beta n/k, (2k + 2H - 3) gamma n/k:
    an interior rank's three messages each way per round in the steady state (two of them added),
    plus the fill and the drain. Together at most their sum (a round's slowest rank may differ)."""
    h = int(math.log2(p))
    for k in (3, 4, 16, 64):
        n = k * 4000
        s = P.pipelined_tree(p, k)
        assert cost(s, n, 1, 0, 0).time == 3 * k + 4 * h - 3
        assert cost(s, n, 0, 1, 0).time == (3 * k + 4 * h - 3) * n // k
        assert cost(s, n, 0, 0, 1).time == (2 * k + 2 * h - 3) * n // k
        a, b, g = ABG
        parts = (3 * k + 4 * h - 3) * (a + b * n / k), (2 * k + 2 * h - 3) * g * n / k
        assert max(parts) <= cost(s, n, a, b, g).time <= sum(parts) * (1 + 1e-12)
    for k in (1, 2, 5, 32):
        # any p: never above three messages each way in each of the 2H + k - 1 rounds
        n = k * 4000
        bound = (2 * h + k - 1) * (3 * ABG[0] + 3 * ABG[1] * n / k + 2 * ABG[2] * n / k)
        assert cost(P.pipelined_tree(p + 1, k), n, *ABG).time <= bound * (1 + 1e-12)


def test_pipelining_beats_the_whole_buffer_tree_for_large_buffers_only():
    """p = 64, 16 MiB: k = 64 pieces take 0.33x the binomial tree's time;
    at 64 KiB one piece is best."""
    big, small = 16 << 20, 64 << 10
    tree = cost(tree_mod.allreduce(64), big, *ABG, 4).time
    assert cost(P.pipelined_tree(64, 64), big, *ABG, 4).time / tree == pytest.approx(
        0.334, abs=0.01
    )
    times = {k: cost(P.pipelined_tree(64, k), small, *ABG, 4).time for k in (1, 2, 4, 8, 16)}
    assert min(times, key=times.get) == 2 and times[16] > times[2]


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
def test_pipelined_ring_buys_nothing_in_the_round_model(p):
    """Same bytes, k times the messages: exactly the ring's time + 2(p-1)(k-1) alpha (pk | n)."""
    for k in (1, 2, 4, 8):
        n = p * k * 1000
        ring = cost(ring_mod.allreduce(p), n, *ABG)
        piped = cost(P.pipelined_ring(p, k), n, *ABG)
        assert piped.time == pytest.approx(ring.time + 2 * (p - 1) * (k - 1) * ABG[0], rel=1e-12)
        assert piped.bytes_sent_max == ring.bytes_sent_max == 2 * (p - 1) * n // p
        assert cost(P.pipelined_ring(p, k), n, 1, 0, 0).time == 2 * (p - 1) * k


@pytest.mark.parametrize("p", [2, 3, 8, 16])
def test_sliced_ring_time_is_the_ring_at_one_slice_and_hides_gamma_with_more(p):
    for n in (p << 16, p << 20, p << 24):
        assert P.sliced_ring_time(p, n, *ABG, 1) == pytest.approx(
            cost(ring_mod.allreduce(p), n, *ABG).time
        )
    n, ks = p << 22, (1, 2, 4, 8, 16)
    wire = 2 * (p - 1) / p * n * ABG[1]  # the link alone: alpha and gamma fully hidden
    times = {k: P.sliced_ring_time(p, n, *ABG, k) for k in ks}
    gamma = cost(ring_mod.allreduce(p), n, 0, 0, ABG[2]).time
    assert times[1] == pytest.approx(cost(ring_mod.allreduce(p), n, *ABG).time)
    assert min(times, key=times.get) == 2  # the adder (20 GB/s) outruns the link: 2 slices hide it
    assert times[2] < times[1] - 0.9 * gamma + 2 * (p - 1) * ABG[0]
    no_alpha = [P.sliced_ring_time(p, n, 0, *ABG[1:], k) for k in ks]
    assert no_alpha[0] > no_alpha[1] and all(
        t == pytest.approx(wire, rel=1e-9) for t in no_alpha[1:]
    )
    # small: alpha wins
    assert P.sliced_ring_time(p, 4096, *ABG, 16) > P.sliced_ring_time(p, 4096, *ABG, 1)
    assert P.sliced_ring_time(1, n, *ABG, 4) == 0.0


def test_sliced_ring_docstring_numbers():
    n, ring = 16 << 20, cost(ring_mod.allreduce(8), 16 << 20, *ABG).time
    assert round(P.sliced_ring_time(8, n, *ABG, 2) / ring, 2) == 0.82
    assert round(P.sliced_ring_time(8, n, *ABG, 16) / ring, 2) == 1.08
