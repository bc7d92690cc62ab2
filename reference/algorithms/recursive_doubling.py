"""Recursive doubling all-reduce: lg p rounds of pairwise exchanges of the whole buffer.

MPICH's choice for short messages. In round k every rank exchanges its whole buffer with the
rank 2^k away (virtual rank with bit k flipped) and both add what they receive: after lg p
rounds everyone holds the sum. Both partners send the SAME chunk in one round, so a send
carries a snapshot of the chunk as the round began (``schedule.messages_of``). Any p: the
first 2 (p - p') ranks (p' = 2^floor(lg p)) fold pairwise first, the odd one sitting out until
a last round copies the result back. For p = 6:

    p = 6, chunk a; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0]
      r1 [a1]  --a1--> r0
      r2 [a2]
      r3 [a3]  --a3--> r2
      r4 [a4]
      r5 [a5]
    round 1
      r0 [a01]  --a01--> r2
      r1 [a1]
      r2 [a23]  --a23--> r0
      r3 [a3]
      r4 [a4]   --a4--> r5
      r5 [a5]   --a5--> r4
    round 2
      r0 [a0123]  --a0123--> r4
      r1 [a1]
      r2 [a0123]  --a0123--> r5
      r3 [a3]
      r4 [a45]    --a45--> r0
      r5 [a45]    --a45--> r2
    round 3
      r0 [a012345]  ==a012345==> r1
      r1 [a1]
      r2 [a012345]  ==a012345==> r3
      r3 [a3]
      r4 [a012345]
      r5 [a012345]
    after round 3
      r0 [a012345]
      r1 [a012345]
      r2 [a012345]
      r3 [a012345]
      r4 [a012345]
      r5 [a012345]

Rounds: lg p for a power of two, floor(lg p) + 2 otherwise; (alpha + n beta + n gamma) lg p
for p = 2^m: the least latency here and the most bytes, so engines use it for small messages.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer

__all__ = ["fold", "allreduce"]


def fold(p: int) -> tuple[int, int, list[int]]:
    """(p', rem, real rank of each virtual rank): the ranks that take part after the fold.

    Args:
        p: the number of ranks.

    Returns:
        (p', rem, real): the largest power of two p' <= p, rem = p - p', and the real rank of each
        virtual rank.
    """
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    return pof2, rem, [2 * v if v < rem else v + rem for v in range(pof2)]


def allreduce(p: int) -> Schedule:
    """Recursive doubling: in round i every rank swaps its whole buffer with the rank 2^i away.

    Args:
        p: the number of ranks (any p; not a power of two: the fold).

    Returns:
        The schedule named "recursive_doubling": one chunk, lg p' rounds plus two for the fold.
    """
    pof2, rem, real = fold(p)
    rounds: list[tuple[Transfer, ...]] = []
    if rem:  # odd ranks below 2 rem hand their buffer to the even one below and sit out
        rounds.append(tuple(Transfer(2 * i + 1, 2 * i, 0, "reduce") for i in range(rem)))
    d = 1
    while d < pof2:  # exchange with the virtual rank d away; both add
        rounds.append(tuple(Transfer(real[v], real[v ^ d], 0, "reduce") for v in range(pof2)))
        d *= 2
    if rem:  # and get the result back
        rounds.append(tuple(Transfer(2 * i, 2 * i + 1, 0, "copy") for i in range(rem)))
    return Schedule("recursive_doubling", p, 1, tuple(rounds))
