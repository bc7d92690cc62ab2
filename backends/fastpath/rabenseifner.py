"""Rabenseifner's schedules built as arrays, one ``Round`` per round: the same schedules as
``dplab.reference.algorithms.rabenseifner`` (the readable builder, the source), row for row
(``tests/test_spine_equals_engine.py``), built fast enough to price p = 4096 (33.5 M transfers),
where building them ``Transfer`` by ``Transfer`` takes minutes and gigabytes.

    from dplab.backends.fastpath import rabenseifner
    rabenseifner.allreduce(4096)          # equal to dplab.reference.algorithms.rabenseifner.allreduce(4096)
"""

from __future__ import annotations

import numpy as np

from dplab.reference.algorithms.recursive_doubling import fold
from dplab.reference.schedule import Op, Round, Schedule

__all__ = ["reduce_scatter", "allgather", "allreduce"]

# Every round is built as arrays, in the readable builder's order: by chunk, then by sender.


def _owners(start: np.ndarray) -> np.ndarray:
    """The virtual rank that owns each chunk (``start[v]`` is virtual rank v's first chunk)."""
    return np.repeat(np.arange(len(start) - 1), np.diff(start))


def _round(real: np.ndarray, start: np.ndarray, d: int, base: np.ndarray, op: Op) -> Round:
    """Chunk c goes from the d virtual ranks ``base[owner(c)] + 0..d-1`` to each one's partner v ^ d
    (chunk by chunk, senders in rank order: ``real`` is increasing)."""
    chunks = np.arange(int(start[-1]))
    v = np.repeat(base[_owners(start)], d) + np.tile(np.arange(d), chunks.size)
    return Round(real[v], real[v ^ d], np.repeat(chunks, d), op)


def _halving(pof2: int, real: np.ndarray, start: np.ndarray) -> list[Round]:
    """Recursive halving among the p' virtual ranks: partners d apart, each sends the half of its
    group its partner keeps, so chunk c of virtual rank w comes from the d ranks whose partners
    share w's aligned block of d: ``(w & ~(d-1)) ^ d`` and up."""
    w = np.arange(pof2)
    ds = [pof2 >> i for i in range(1, pof2.bit_length())]  # p'/2, p'/4, ..., 1
    return [_round(real, start, d, (w & ~(d - 1)) ^ d, "reduce") for d in ds]


def _doubling(pof2: int, real: np.ndarray, start: np.ndarray) -> list[Round]:
    """Recursive doubling among the virtual ranks: send everything gathered so far, i.e. the
    chunks of one's own aligned block of d, so chunk c of w comes from that block's d ranks."""
    w = np.arange(pof2)
    ds = [1 << i for i in range(pof2.bit_length() - 1)]  # 1, 2, ..., p'/2
    return [_round(real, start, d, w & ~(d - 1), "copy") for d in ds]


def _whole(rem: int, chunks: int, op: Op, down: bool, skip_own: bool = False) -> Round:
    """The fold: odd rank 2i+1 hands chunks 0..chunks-1 to 2i (``down``), or 2i hands them back
    (``skip_own``: all but chunk 2i+1, which the partner already has). Chunk by chunk, i inside."""
    c, i = np.repeat(np.arange(chunks), rem), np.tile(np.arange(rem), chunks)
    if skip_own:
        c, i = c[c != 2 * i + 1], i[c != 2 * i + 1]
    return Round(2 * i + 1, 2 * i, c, op) if down else Round(2 * i, 2 * i + 1, c, op)


def _setup(p: int, pairs_own_two: bool) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(p', rem, real rank of each virtual rank, each virtual rank's first chunk and the end):
    with ``pairs_own_two`` virtual rank v < rem owns chunks 2v, 2v+1 (its real pair's), the
    others one each (p chunks: the reduce-scatter's layout); else v owns chunk v (p' chunks)."""
    pof2, rem, real = fold(p)
    owned = 1 + (np.arange(pof2) < rem) * pairs_own_two
    return pof2, rem, np.asarray(real, np.int64), np.concatenate(([0], np.cumsum(owned)))


def reduce_scatter(p: int) -> Schedule:
    pof2, rem, real, start = _setup(p, pairs_own_two=True)
    rounds = [_whole(rem, p, "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start)
    if rem:
        i = np.arange(rem)
        rounds.append(Round(2 * i, 2 * i + 1, 2 * i + 1, "copy"))
    return Schedule("rabenseifner_reduce_scatter", p, p, rounds)


def allgather(p: int) -> Schedule:
    pof2, rem, real, start = _setup(p, pairs_own_two=True)
    i = np.arange(rem)
    rounds = [Round(2 * i + 1, 2 * i, 2 * i + 1, "copy")] if rem else []
    rounds += _doubling(pof2, real, start)
    if rem:  # everything but the partner's own chunk
        rounds.append(_whole(rem, p, "copy", down=False, skip_own=True))
    return Schedule("rabenseifner_allgather", p, p, rounds)


def allreduce(p: int) -> Schedule:
    pof2, rem, real, start = _setup(p, pairs_own_two=False)  # p' even chunks, v owns chunk v
    rounds = [_whole(rem, pof2, "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start) + _doubling(pof2, real, start)
    if rem:
        rounds.append(_whole(rem, pof2, "copy", down=False))
    return Schedule("rabenseifner", p, pof2, rounds)
