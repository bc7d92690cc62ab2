"""Recursive doubling all-reduce: lg p rounds of pairwise exchanges of the whole buffer.

MPICH's choice for short messages (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", section 4.4). The buffer travels whole, as one
chunk. In round k every rank exchanges its buffer with the rank 2^k away (its virtual rank
with bit k flipped) and both add what they receive: after round k each rank holds the sum
over its aligned group of 2^(k+1) ranks, so after lg p rounds everyone holds everything.
It is the only schedule here where two ranks send each other the SAME chunk in the same
round, each adding the other's into its own: a send carries the value the chunk had at the
start of the round, so the executor sends a snapshot of it (``schedule.messages_of``).

Any p: with p' = 2^floor(lg p) and rem = p - p', the first 2 rem ranks pair up first; each
odd one sends its buffer to the even one below it, which adds it, and sits out (MPICH's code
does the mirror image: even ranks send). The p' ranks left (virtual rank v is real rank 2v
for v < rem, v + rem after) run the exchanges, and a last round copies the result back to
the ranks that sat out. The all-reduce for p = 6 (drawn by ``dplab.reference.pictures``
from the schedule below, through the simulator):

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

Rounds: lg p for a power of two, floor(lg p) + 2 otherwise. Every round moves the whole
buffer: (alpha + n beta + n gamma) lg p for p = 2^m, the least latency of any all-reduce
here (one message per round, no chunking) and the most bytes: lg p times the ring's
2 (p-1)/p n for large p. So engines use it for small messages only.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer

__all__ = ["fold", "allreduce"]


def fold(p: int) -> tuple[int, int, list[int]]:
    """(p', rem, real rank of each virtual rank): the ranks that take part after the fold."""
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    return pof2, rem, [2 * v if v < rem else v + rem for v in range(pof2)]


def allreduce(p: int) -> Schedule:
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
