"""Naive all-reduce: everyone sends its whole buffer to a root, the root sends the sum back.

The whole buffer is one chunk, a; for p = 3 (drawn by ``dplab.reference.pictures``):

    p = 3, chunk a; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0]
      r1 [a1]  --a1--> r0
      r2 [a2]  --a2--> r0
    round 1
      r0 [a012]  ==a012==> r1 r2
      r1 [a1]
      r2 [a2]
    after round 1
      r0 [a012]
      r1 [a012]
      r2 [a012]

Two rounds, but the root receives and sends (p-1) full buffers while the others
idle: 2(p-1) n bytes through one port. The baseline every other algorithm beats.
The root adds the incoming buffers in rank order, so the result is deterministic.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer, concat

__all__ = ["reduce", "broadcast", "allreduce"]


def reduce(p: int, root: int = 0) -> Schedule:
    """Every rank sends its whole buffer to ``root`` in one round, and the root adds them up.

    Args:
        p: the number of ranks.
        root: the rank that ends with the sum.

    Returns:
        A one-chunk schedule of one round (none for p = 1).
    """
    sends = tuple(Transfer(r, root, 0, "reduce") for r in range(p) if r != root)
    return Schedule("naive_reduce", p, 1, (sends,) if sends else ())


def broadcast(p: int, root: int = 0) -> Schedule:
    """``root`` sends its whole buffer to every other rank in one round.

    Args:
        p: the number of ranks.
        root: the rank whose buffer everyone ends with.

    Returns:
        A one-chunk schedule of one round (none for p = 1).
    """
    sends = tuple(Transfer(root, r, 0, "copy") for r in range(p) if r != root)
    return Schedule("naive_broadcast", p, 1, (sends,) if sends else ())


def allreduce(p: int) -> Schedule:
    """Reduce to rank 0, then broadcast from it: the plainest all-reduce.

    Args:
        p: the number of ranks.

    Returns:
        The schedule named "naive": two rounds, the root's link carries everything.
    """
    return concat("naive", reduce(p), broadcast(p))
