"""The pipelined ring built as ``Round`` arrays gives the SAME schedules as the
``Transfer``-by-``Transfer`` construction it replaced (kept here, verbatim, as the oracle).
Rabenseifner's readable builder is the source, and its array builder on the engine side is
held to it in ``test_spine_equals_engine.py``.

    pytest -q tests/test_alg_arrays.py
"""

from __future__ import annotations

import pytest

from dplab.reference.algorithms import pipelined, ring
from dplab.reference.schedule import Schedule, Transfer

# ---- the Transfer-based construction, as it was (commit 79878d5) --------------------------------


def old_pipelined_ring(p, k):
    steps = ring.reduce_scatter(p).rounds + ring.allgather(p).rounds
    timed = {}
    for s, step in enumerate(steps):
        for j in range(k):
            timed.setdefault(s + j, []).extend(Transfer(t.src, t.dst, t.chunk * k + j, t.op) for t in step)
    last = max(timed, default=-1)
    rounds = tuple(tuple(sorted(timed.get(i, ()), key=lambda t: t.chunk)) for i in range(last + 1))
    return Schedule("pipelined_ring", p, p * k, rounds)


# ---- the new construction equals it, row for row (same rounds, same order within a round) ------

def _same(new: Schedule, old: Schedule) -> None:
    assert (new.name, new.world_size, new.num_chunks) == (old.name, old.world_size, old.num_chunks)
    assert new.table.equals(old.table)  # row for row: order within a round is the order messages post in
    if new.world_size <= 8:
        assert new.rounds == old.rounds


@pytest.mark.parametrize("p", range(1, 65))
def test_pipelined_ring_as_arrays_equals_the_transfer_construction(p):
    for k in (1, 2, 5) + ((16,) if p % 16 == 1 or p < 5 else ()):
        _same(pipelined.pipelined_ring(p, k), old_pipelined_ring(p, k))
