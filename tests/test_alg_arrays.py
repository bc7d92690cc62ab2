"""Rabenseifner and the pipelined ring built as ``Round`` arrays give the SAME schedules as the
``Transfer``-by-``Transfer`` construction they replaced (kept here, verbatim, as the oracle).

    pytest -q tests/test_alg_arrays.py
"""

from __future__ import annotations

import pytest

from dplab.reference.algorithms import pipelined, rabenseifner, ring
from dplab.reference.algorithms.recursive_doubling import fold
from dplab.reference.schedule import Schedule, Transfer

# ---- the Transfer-based construction, as it was (commit 79878d5) --------------------------------


def _old_by_chunk(transfers):
    return tuple(sorted(transfers, key=lambda t: (t.chunk, t.src)))


def _old_halving(pof2, real, start):
    rounds, d = [], pof2 // 2
    while d >= 1:
        rnd = []
        for v in range(pof2):
            u = v ^ d
            lo = u & ~(d - 1)
            rnd += [Transfer(real[v], real[u], c, "reduce") for c in range(start[lo], start[lo + d])]
        rounds.append(_old_by_chunk(rnd))
        d //= 2
    return rounds


def _old_doubling(pof2, real, start):
    rounds, d = [], 1
    while d < pof2:
        rnd = []
        for v in range(pof2):
            lo = v & ~(d - 1)
            rnd += [Transfer(real[v], real[v ^ d], c, "copy") for c in range(start[lo], start[lo + d])]
        rounds.append(_old_by_chunk(rnd))
        d *= 2
    return rounds


def _old_whole(rem, chunks, op, down):
    return _old_by_chunk([Transfer(2 * i + 1, 2 * i, c, op) if down else Transfer(2 * i, 2 * i + 1, c, op)
                          for i in range(rem) for c in chunks])


def old_reduce_scatter(p):
    pof2, rem, real = fold(p)
    start = [v + min(v, rem) for v in range(pof2 + 1)]
    rounds = [_old_whole(rem, range(p), "reduce", down=True)] if rem else []
    rounds += _old_halving(pof2, real, start)
    if rem:
        rounds.append(tuple(Transfer(2 * i, 2 * i + 1, 2 * i + 1, "copy") for i in range(rem)))
    return Schedule("rabenseifner_reduce_scatter", p, p, tuple(rounds))


def old_allgather(p):
    pof2, rem, real = fold(p)
    start = [v + min(v, rem) for v in range(pof2 + 1)]
    rounds = [tuple(Transfer(2 * i + 1, 2 * i, 2 * i + 1, "copy") for i in range(rem))] if rem else []
    rounds += _old_doubling(pof2, real, start)
    if rem:
        rounds.append(_old_by_chunk([Transfer(2 * i, 2 * i + 1, c, "copy")
                                     for i in range(rem) for c in range(p) if c != 2 * i + 1]))
    return Schedule("rabenseifner_allgather", p, p, tuple(rounds))


def old_allreduce(p):
    pof2, rem, real = fold(p)
    start = list(range(pof2 + 1))
    rounds = [_old_whole(rem, range(pof2), "reduce", down=True)] if rem else []
    rounds += _old_halving(pof2, real, start) + _old_doubling(pof2, real, start)
    if rem:
        rounds.append(_old_whole(rem, range(pof2), "copy", down=False))
    return Schedule("rabenseifner", p, pof2, tuple(rounds))


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
def test_rabenseifner_as_arrays_equals_the_transfer_construction(p):
    _same(rabenseifner.allreduce(p), old_allreduce(p))
    _same(rabenseifner.reduce_scatter(p), old_reduce_scatter(p))
    _same(rabenseifner.allgather(p), old_allgather(p))


@pytest.mark.parametrize("p", range(1, 65))
def test_pipelined_ring_as_arrays_equals_the_transfer_construction(p):
    for k in (1, 2, 5) + ((16,) if p % 16 == 1 or p < 5 else ()):
        _same(pipelined.pipelined_ring(p, k), old_pipelined_ring(p, k))
