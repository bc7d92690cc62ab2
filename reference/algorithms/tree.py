"""Binomial-tree all-reduce: binomial reduce to the root, then binomial broadcast.

The whole buffer travels as one chunk. In reduce round k, every rank whose
distance from the root (its "virtual rank" v = (r - root) mod p) has lowest set
bit 2^k sends to v - 2^k, which adds it. After ceil(lg p) rounds the root holds
the sum. The broadcast runs the same tree backwards with copies. Works for any p:
a rank whose partner v + 2^k would be >= p just sits the round out: for p = 6, rank 4
has no partner in round 1 (it would pair with 6, which does not exist). The reduce for
p = 6 (root 0), and the tree it builds, one line per leaf (drawn by
``dplab.reference.pictures.render_arrows`` and ``render_tree`` from the schedule below):

    round 0 (adds):  1->0   3->2   5->4
    round 1 (adds):  2->0
    round 2 (adds):  4->0

    0 <- 1
    0 <- 2 <- 3
    0 <- 4 <- 5

The broadcast is the same arrows reversed, rounds in the opposite order.
Latency: 2 ceil(lg p) messages on the critical path. Bandwidth: the whole buffer
crosses every tree edge twice, 2 n lg p bytes on the critical path, so trees win
for small buffers and lose to the ring for big ones.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer, concat

__all__ = ["reduce", "broadcast", "allreduce"]


def _edges(p: int, root: int) -> list[list[tuple[int, int]]]:
    """(child, parent) pairs of each reduce round, as real ranks."""
    rounds, step = [], 1
    while step < p:
        pairs = [(v, v - step) for v in range(step, p, 2 * step)]
        rounds.append([((c + root) % p, (q + root) % p) for c, q in pairs])
        step *= 2
    return rounds


def reduce(p: int, root: int = 0) -> Schedule:
    """Binomial reduce to ``root``: in round i, ranks 2^i apart pair up and one hands its sum up.

    Args:
        p: the number of ranks (any p, not only powers of two).
        root: the rank that ends with the sum.

    Returns:
        A one-chunk schedule of ceil(lg p) rounds.
    """
    rounds = tuple(
        tuple(Transfer(c, q, 0, "reduce") for c, q in pairs) for pairs in _edges(p, root)
    )
    return Schedule("tree_reduce", p, 1, rounds)


def broadcast(p: int, root: int = 0) -> Schedule:
    """Binomial broadcast from ``root``: the reduce's rounds reversed, each edge copying down.

    Args:
        p: the number of ranks (any p, not only powers of two).
        root: the rank whose buffer everyone ends with.

    Returns:
        A one-chunk schedule of ceil(lg p) rounds.
    """
    rounds = tuple(
        tuple(Transfer(q, c, 0, "copy") for c, q in pairs) for pairs in reversed(_edges(p, root))
    )
    return Schedule("tree_broadcast", p, 1, rounds)


def allreduce(p: int) -> Schedule:
    """The tree all-reduce: binomial reduce to rank 0, then binomial broadcast from it.

    Args:
        p: the number of ranks.

    Returns:
        The schedule named "tree": 2 ceil(lg p) rounds of one chunk.
    """
    return concat("tree", reduce(p), broadcast(p))
