"""Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather.

MPICH's choice for medium and long messages (Thakur, Rabenseifner & Gropp 2005, "Optimization
of Collective Communication Operations in MPICH", section 4.4; MPICH's
``allreduce_intra_reduce_scatter_allgather.c`` and ``reduce_scatter_intra_recursive_halving.c``).
It moves the ring's bytes, 2 (p-1)/p n per rank, in 2 lg p rounds instead of 2 (p-1).

Recursive halving (the reduce-scatter), p = 2^m ranks: in the first round each rank pairs with
the rank p/2 away; the lower one sends the upper half of the buffer (the half its partner's
side will own) and adds the lower half it receives, the upper one the reverse. Next round the
same inside each half, with partners p/4 away and quarters of the buffer, and so on: after
lg p rounds rank r holds chunk r summed over everyone, having sent n/2 + n/4 + ... = (p-1)/p n.
Recursive doubling (the all-gather) runs it backwards with copies: partners 1, 2, 4, ... away,
each round sending everything gathered so far. For p = 4 (drawn by ``dplab.reference.pictures``
from the schedule below, through the simulator):

    p = 4, chunks a b c d; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0 c0 d0]  --c0--> r2  --d0--> r2
      r1 [a1 b1 c1 d1]  --c1--> r3  --d1--> r3
      r2 [a2 b2 c2 d2]  --a2--> r0  --b2--> r0
      r3 [a3 b3 c3 d3]  --a3--> r1  --b3--> r1
    round 1
      r0 [a02 b02 c0  d0]   --b02--> r1
      r1 [a13 b13 c1  d1]   --a13--> r0
      r2 [a2  b2  c02 d02]  --d02--> r3
      r3 [a3  b3  c13 d13]  --c13--> r2
    round 2
      r0 [a0123 b02   c0    d0]     ==a0123==> r1
      r1 [a13   b0123 c1    d1]     ==b0123==> r0
      r2 [a2    b2    c0123 d02]    ==c0123==> r3
      r3 [a3    b3    c13   d0123]  ==d0123==> r2
    round 3
      r0 [a0123 b0123 c0    d0]     ==a0123==> r2  ==b0123==> r2
      r1 [a0123 b0123 c1    d1]     ==a0123==> r3  ==b0123==> r3
      r2 [a2    b2    c0123 d0123]  ==c0123==> r0  ==d0123==> r0
      r3 [a3    b3    c0123 d0123]  ==c0123==> r1  ==d0123==> r1
    after round 3
      r0 [a0123 b0123 c0123 d0123]
      r1 [a0123 b0123 c0123 d0123]
      r2 [a0123 b0123 c0123 d0123]
      r3 [a0123 b0123 c0123 d0123]

A round's chunks to one peer are consecutive, so they travel as ONE message (the executor and
the cost model coalesce them: ``schedule.messages_of``): lg p messages per phase, not p - 1.

Any p: with p' = 2^floor(lg p) and rem = p - p', the first 2 rem ranks pair up; each odd one
adds its whole buffer into the even one below and sits out (MPICH's code: the mirror image),
the p' ranks left run the rounds above, and the sitting-out ranks get their part back at the
end. The all-reduce cuts the buffer into p' chunks (even halves, MPICH's allreduce) and copies
the whole result back: 2 floor(lg p) + 2 rounds. The reduce-scatter (``SCATTER``, what ZeRO and
FSDP call) must leave chunk r of ``chunk_bounds(n, p)`` on rank r for every r, so it keeps p
chunks: virtual rank v < rem owns chunks 2v and 2v+1 (its own and its partner's), the others
one each (MPICH's ``newcnts``), and a last round copies chunk 2v+1 to the partner. Those
halves are uneven (a virtual rank with two chunks weighs double), the price of the fold. The
all-gather is the mirror: partners first copy their chunk in, recursive doubling, and the
whole result goes back out. The reduce-scatter for p = 3:

    p = 3, chunks a b c; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0 c0]
      r1 [a1 b1 c1]  --a1--> r0  --b1--> r0  --c1--> r0
      r2 [a2 b2 c2]
    round 1
      r0 [a01 b01 c01]  --c01--> r2
      r1 [a1  b1  c1]
      r2 [a2  b2  c2]   --a2--> r0  --b2--> r0
    round 2
      r0 [a012 b012 c01]   ==b012==> r1
      r1 [a1   b1   c1]
      r2 [a2   b2   c012]
    after round 2
      r0 [a012 b012 c01]
      r1 [a1   b012 c1]
      r2 [a2   b2   c012]

Cost for p = 2^m (alpha per message, beta per byte, gamma per byte added):
2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma, the ring's bytes with the tree's latency.
Otherwise the fold adds a whole-buffer reduce and copy: with p' = 2^floor(lg p),
(2 lg p' + 2) alpha + (2 (p'-1)/p' + 2) n beta + ((p'-1)/p' + 1) n gamma
(``costmodel.closed_form``; ``tests/test_alg_rabenseifner.py`` checks the walk against it).
"""

from __future__ import annotations

import numpy as np

from dplab.reference.algorithms.recursive_doubling import fold
from dplab.reference.schedule import Op, Round, Schedule

__all__ = ["reduce_scatter", "allgather", "allreduce"]

# Every round below is built as arrays (``Round``), in the order its picture draws it: by chunk,
# then by sender. At p = 4096 that is 33.5 M transfers in a second or two; Transfer by Transfer
# it was 57 s and 5.6 GB. ``tests/test_alg_arrays.py`` keeps the Transfer version as the oracle.


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
