"""Direct ("two-shot") all-reduce: every rank reduces its own chunk from all peers at once.

Round 0 is a reduce-scatter in one step: every rank r sends chunk d straight to
its owner d, for every d != r. Round 1 is the all-gather: every owner sends its
finished chunk to every other rank. For p = 3 (drawn by ``dplab.reference.pictures``
from the schedule below, through the simulator):

    p = 3, chunks a b c; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0 c0]  --b0--> r1  --c0--> r2
      r1 [a1 b1 c1]  --a1--> r0  --c1--> r2
      r2 [a2 b2 c2]  --a2--> r0  --b2--> r1
    round 1
      r0 [a012 b0   c0]    ==a012==> r1 r2
      r1 [a1   b012 c1]    ==b012==> r0 r2
      r2 [a2   b2   c012]  ==c012==> r0 r1
    after round 1
      r0 [a012 b012 c012]
      r1 [a012 b012 c012]
      r2 [a012 b012 c012]

Same bytes as the ring (2(p-1)/p n per rank) in 2 rounds instead of 2(p-1), but
each rank talks to p-1 peers per round. On a single-port network that costs
(p-1) alphas per round; on shared memory, where every rank can read every peer's
buffer, it is what intra-node engines do, so the local backend uses it as its
native all-reduce.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer, concat

__all__ = ["reduce_scatter", "allgather", "allreduce"]


def reduce_scatter(p: int) -> Schedule:
    # to owner d
    """Every rank sends chunk d straight to its owner d, all in one round.

    Args:
        p: the number of ranks.

    Returns:
        p chunks in one round of p(p - 1) transfers (none for p = 1).
    """
    sends = tuple(Transfer(r, d, d, "reduce") for d in range(p) for r in range(p) if r != d)
    return Schedule("direct_reduce_scatter", p, p, (sends,) if p > 1 else ())


def allgather(p: int) -> Schedule:
    # owner d to all
    """Every owner d sends its chunk d straight to every other rank, in one round.

    Args:
        p: the number of ranks.

    Returns:
        p chunks in one round of p(p - 1) transfers (none for p = 1).
    """
    sends = tuple(Transfer(d, r, d, "copy") for d in range(p) for r in range(p) if r != d)
    return Schedule("direct_allgather", p, p, (sends,) if p > 1 else ())


def allreduce(p: int) -> Schedule:
    """The direct all-reduce: every rank talks to every other, two rounds in all.

    Args:
        p: the number of ranks.

    Returns:
        The schedule named "direct": the reduce-scatter, then the all-gather.
    """
    return concat("direct", reduce_scatter(p), allgather(p))
