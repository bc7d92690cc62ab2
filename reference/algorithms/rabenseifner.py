"""Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather.

MPICH's choice for medium and long messages: the ring's bytes, 2 (p-1)/p n per rank, in 2 lg p
rounds. Halving: each rank pairs with the rank p/2 away, sends the half its partner will own
and adds the half it receives; then the same inside each half, p/4 away, and so on, until rank
r holds chunk r summed. Doubling runs it backwards with copies. A round's chunks to one peer
travel as one message (``schedule.messages_of``). For p = 4:

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

Any p: with p' = 2^floor(lg p), the first 2 (p - p') ranks pair up, each odd one adds its buffer
into the even one below and sits out until a last round copies its part back. The
reduce-scatter (``SCATTER``) must leave chunk r of ``chunk_bounds(n, p)`` on rank r, so it
keeps p chunks (a folded virtual rank owns two, MPICH's ``newcnts``); for p = 3:

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

Cost (``costmodel.closed_form``): 2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma for p = 2^m;
the fold adds a whole-buffer reduce and copy. Sources: reference/README.md, "The algorithms".
"""

from __future__ import annotations

from dplab.reference.algorithms.recursive_doubling import fold
from dplab.reference.schedule import Op, Schedule, Transfer

__all__ = ["reduce_scatter", "allgather", "allreduce"]

# Every round lists its transfers chunk by chunk, senders in rank order: the order the picture
# above draws them in, and the order the executor posts a rank's messages in.


def _by_chunk(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    return tuple(sorted(transfers, key=lambda t: (t.chunk, t.src)))


def _halving(pof2: int, real: list[int], start: list[int]) -> list[tuple[Transfer, ...]]:
    """Recursive halving among the p' virtual ranks, partners d = p'/2, p'/4, ..., 1 apart: virtual
    rank v sends its partner u = v ^ d the chunks of u's aligned block of d virtual ranks (the
    half of v's group that u keeps), and u adds them. ``start[w]``: virtual rank w's first chunk."""
    rounds, d = [], pof2 // 2
    while d >= 1:
        sends = []
        for v in range(pof2):
            u = v ^ d
            lo = u & ~(d - 1)  # u's block: virtual ranks lo .. lo + d - 1
            sends += [
                Transfer(real[v], real[u], c, "reduce") for c in range(start[lo], start[lo + d])
            ]
        rounds.append(_by_chunk(sends))
        d //= 2
    return rounds


def _doubling(pof2: int, real: list[int], start: list[int]) -> list[tuple[Transfer, ...]]:
    """Recursive doubling among the virtual ranks, partners d = 1, 2, ..., p'/2 apart: v sends
    everything it has gathered so far, the chunks of its own aligned block of d, and v ^ d copies
    them."""
    rounds, d = [], 1
    while d < pof2:
        sends = []
        for v in range(pof2):
            lo = v & ~(d - 1)
            sends += [
                Transfer(real[v], real[v ^ d], c, "copy") for c in range(start[lo], start[lo + d])
            ]
        rounds.append(_by_chunk(sends))
        d *= 2
    return rounds


def _whole(rem: int, chunks: range, op: Op, down: bool) -> tuple[Transfer, ...]:
    """The fold: odd rank 2i+1 hands ``chunks`` to 2i (``down``), or 2i hands them back."""
    return _by_chunk(
        [
            Transfer(2 * i + 1, 2 * i, c, op) if down else Transfer(2 * i, 2 * i + 1, c, op)
            for i in range(rem)
            for c in chunks
        ]
    )


def _start(p: int, pairs_own_two: bool) -> list[int]:
    """Each virtual rank's first chunk, and the end: with ``pairs_own_two`` virtual rank v < rem
    owns chunks 2v, 2v+1 (its real pair's), the others one each (p chunks: the reduce-scatter's
    layout); else v owns chunk v (p' chunks)."""
    pof2, rem, _ = fold(p)
    return [v + min(v, rem) if pairs_own_two else v for v in range(pof2 + 1)]


def reduce_scatter(p: int) -> Schedule:
    """Rabenseifner's reduce-scatter: the fold, then recursive halving; rank r ends owning chunk r.

    Args:
        p: the number of ranks (any p; not a power of two: the fold).

    Returns:
        p chunks, lg p' rounds plus two for the fold.
    """
    pof2, rem, real = fold(p)
    start = _start(p, pairs_own_two=True)
    rounds = [_whole(rem, range(p), "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start)
    if rem:  # the partner's own chunk goes back to it
        rounds.append(tuple(Transfer(2 * i, 2 * i + 1, 2 * i + 1, "copy") for i in range(rem)))
    return Schedule("rabenseifner_reduce_scatter", p, p, tuple(rounds))


def allgather(p: int) -> Schedule:
    """Rabenseifner's all-gather: the fold, then recursive doubling; each rank ends with all chunks.

    Args:
        p: the number of ranks (any p; not a power of two: the fold).

    Returns:
        p chunks, lg p' rounds plus two for the fold.
    """
    pof2, rem, real = fold(p)
    start = _start(p, pairs_own_two=True)
    rounds = (
        [tuple(Transfer(2 * i + 1, 2 * i, 2 * i + 1, "copy") for i in range(rem))] if rem else []
    )
    rounds += _doubling(pof2, real, start)
    if rem:  # everything but the partner's own chunk
        rounds.append(_by_chunk([Transfer(2 * i, 2 * i + 1, c, "copy")
                                 for i in range(rem) for c in range(p) if c != 2 * i + 1]))
    return Schedule("rabenseifner_allgather", p, p, tuple(rounds))


def allreduce(p: int) -> Schedule:
    """Rabenseifner's all-reduce: recursive halving (reduce-scatter) then doubling (all-gather).

    Args:
        p: the number of ranks (any p; not a power of two: the fold).

    Returns:
        The schedule named "rabenseifner" over p' chunks: 2 lg p' rounds, 2 more with the fold.
    """
    pof2, rem, real = fold(p)
    start = _start(p, pairs_own_two=False)  # p' even chunks, virtual rank v owns chunk v
    rounds = [_whole(rem, range(pof2), "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start) + _doubling(pof2, real, start)
    if rem:
        rounds.append(_whole(rem, range(pof2), "copy", down=False))
    return Schedule("rabenseifner", p, pof2, tuple(rounds))
