"""Pricing at p = 4096: schedules stored as columns, summarised once, priced for many sizes at once.

Before the columns, the ring at p = 4096 was 33.5 M ``Transfer`` objects (minutes, gigabytes) and
the cost model walked them one by one per size. The bounds below are CPU seconds, generous (this
machine measured ring 1.4 s to build + 1.5 s to price 20 sizes; direct 2.7 + 2.7; hierarchical:8
0.8 + 3.5), so a loaded machine does not fail them but a return to object-per-transfer would.

Left out: rabenseifner and pipelined_ring still build their rounds as Transfer tuples (at p = 4096:
57 s and 5.6 GB; out of memory under 8 GB): built as ``Round`` arrays they would join.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dplab.reference.algorithms import ALLREDUCE, lookup, ring
from dplab.reference.costmodel import cost, curve
from dplab.reference.topology import PRESETS

SIZES = np.geomspace(1 << 10, 1 << 30, 20).astype(np.int64)
P = 4096


def price(name: str) -> tuple[float, np.ndarray]:
    fn, extra = lookup(ALLREDUCE, name, "all-reduce")
    t0 = time.process_time()
    times = curve(fn(P, *extra), SIZES, PRESETS["dgx-h100"], 4)
    return time.process_time() - t0, times


def test_ring_at_4096_builds_and_prices_20_sizes_in_seconds():
    seconds, times = price("ring")
    assert seconds < 30, seconds
    # every ring round moves b = n / p bytes, and the first rank of each node receives them over
    # InfiniBand (adding them in the reduce-scatter): that rank sets the pace of every round
    topo, b = PRESETS["dgx-h100"], int(SIZES[-1]) // P
    want = 2 * (P - 1) * (topo.inter.alpha + topo.inter.beta * b) + (P - 1) * topo.gamma * b
    assert times[-1] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("name", ["naive", "tree", "recursive_doubling", "double_tree", "pipelined_tree"])
def test_the_light_schedules_price_at_4096_instantly(name):
    if name not in ALLREDUCE:
        pytest.skip(f"{name} is not registered")
    seconds, times = price(name)
    assert seconds < 10 and (np.diff(times) >= 0).all(), (name, seconds)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["direct", "hierarchical:8"])
def test_the_quadratic_schedules_price_at_4096_in_seconds(name):
    seconds, times = price(name)
    assert seconds < 60 and (np.diff(times) >= 0).all(), (name, seconds)


def test_exact_cost_of_an_uneven_size_walks_the_columns_once():
    p = 1024  # 2 M transfers: the exact path is one pass over them per size
    t0 = time.process_time()
    c = cost(ring.allreduce(p), 4 * (p * 100 + 7), topology=PRESETS["dgx-h100"], itemsize=4)
    assert time.process_time() - t0 < 10
    # chunks 0..6 hold 101 elements, the rest 100; a rank sends all but one chunk in each half
    assert c.rounds == 2 * (p - 1) and c.bytes_sent_max == (2 * (p - 1) * 100 + 2 * 7) * 4
