"""Ring all-reduce: reduce-scatter then all-gather around a ring (Patarasuk & Yuan 2009).

The buffer is cut into p chunks. Every rank only ever talks to its right neighbour,
sending one chunk per round, so every link is busy in every round and each rank
moves 2(p-1)/p of the buffer in total: bandwidth-optimal for any p.

Reduce-scatter, round k = 0..p-2: rank r sends chunk (r - k - 1) mod p to r + 1,
which adds it to its own copy. After p-1 rounds rank r holds chunk r summed over
all ranks (the convention of ``reduce_scatter_tensor``: rank r owns chunk r). The
reduce-scatter for p = 3, as ``dplab.reference.pictures.render_rounds`` draws it from the
simulator ("b02" is chunk b holding rank 0's and rank 2's contributions, b0 + b2):

    p = 3, chunks a b c; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0 c0]  --c0--> r1
      r1 [a1 b1 c1]  --a1--> r2
      r2 [a2 b2 c2]  --b2--> r0
    round 1
      r0 [a0  b02 c0]   --b02--> r1
      r1 [a1  b1  c01]  --c01--> r2
      r2 [a12 b2  c2]   --a12--> r0
    after round 1
      r0 [a012 b02  c0]
      r1 [a1   b012 c01]
      r2 [a12  b2   c012]

Each send carries everything its chunk has gathered so far (round 1: a12, not just a2),
and the receiver adds its own part: after round p-2 rank r holds chunk r complete.

All-gather, round k = 0..p-2: rank r sends chunk (r - k) mod p to r + 1, which
copies it. Round 0 forwards the chunk each rank owns; later rounds pass on what
arrived in the previous round, so after p-1 rounds everyone has every chunk.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer, concat

__all__ = ["reduce_scatter", "allgather", "allreduce"]


def reduce_scatter(p: int) -> Schedule:
    """The ring's reduce-scatter: afterwards rank r holds chunk r summed over all ranks.

    Args:
        p: the number of ranks (any p >= 1).

    Returns:
        p chunks in p - 1 rounds, each rank sending one chunk to its right neighbour a round.
    """
    rounds = [tuple(Transfer(r, (r + 1) % p, (r - k - 1) % p, "reduce") for r in range(p))
              for k in range(p - 1)]  # round k
    return Schedule("ring_reduce_scatter", p, p, rounds)


def allgather(p: int) -> Schedule:
    """The ring's all-gather: rank r starts with chunk r complete, and ends with every chunk.

    Args:
        p: the number of ranks (any p >= 1).

    Returns:
        p chunks in p - 1 rounds, each rank copying one chunk to its right neighbour a round.
    """
    rounds = [tuple(Transfer(r, (r + 1) % p, (r - k) % p, "copy") for r in range(p))
              for k in range(p - 1)]  # round k
    return Schedule("ring_allgather", p, p, rounds)


def allreduce(p: int) -> Schedule:
    """The ring all-reduce: the reduce-scatter, then the all-gather.

    Args:
        p: the number of ranks (any p >= 1).

    Returns:
        The schedule named "ring": 2(p - 1) rounds of p chunks.
    """
    return concat("ring", reduce_scatter(p), allgather(p))
