"""Double binary tree all-reduce: two complementary trees, each carrying half of the buffer (NCCL).

A pipelined binary tree's interior ranks move 3n bytes each way, its leaves n. A second tree
whose interior ranks are the first one's leaves (Sanders, Speck & Traff 2009; NCCL's
``ncclGetDtree``), each tree reducing and broadcasting half of the buffer pipelined, gives
every rank 2n bytes each way in 2H + k - 1 rounds, H = ceil(lg p). For even p tree 1 is tree 0
mirrored (rank r in the place of p - 1 - r). For p = 8, each leaf's path to the root, tree 0
then tree 1:

    0 <- 4 <- 2 <- 1
    0 <- 4 <- 2 <- 3
    0 <- 4 <- 6 <- 5
    0 <- 4 <- 6 <- 7

    7 <- 3 <- 1 <- 0
    7 <- 3 <- 1 <- 2
    7 <- 3 <- 5 <- 4
    7 <- 3 <- 5 <- 6

For odd p NCCL's shift leaves rank 0 interior in both trees, so dplab builds the even double
tree over ranks 0..p-2 and hangs rank p-1 under both roots. For p = 7, tree 0 then tree 1:

    0 <- 4 <- 2 <- 1
    0 <- 4 <- 2 <- 3
    0 <- 4 <- 5
    0 <- 6

    5 <- 1 <- 0
    5 <- 1 <- 3 <- 2
    5 <- 1 <- 3 <- 4
    5 <- 6

Cost: time <= (2H + k - 1) (4 alpha + 2 beta n/k + gamma n/k), H = ceil(lg p) for even p,
ceil(lg(p-1)) for odd p.

    ALLREDUCE["double_tree"](8, 4)       # or allreduce_schedule("double_tree:4", 8)
"""

from __future__ import annotations

from dplab.reference.algorithms.pipelined import (
    TREE_PIECES,
    btree,
    check_pieces,
    children_of,
    over_trees,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule

__all__ = ["nccl_dtree", "trees", "roles", "one_tree", "allreduce", "busiest"]


def nccl_dtree(p: int) -> tuple[list[int], list[int]]:
    """Parents in NCCL's two trees, exactly as ncclGetDtree builds them (mirror for even p, shift
    for odd).

    Args:
        p: the number of ranks.

    Returns:
        (tree 0's parents, tree 1's parents), -1 at each root.
    """
    t0 = btree(p)
    if p % 2:  # shift by one: tree 1 is tree 0 with every rank r in r + 1's place
        return t0, [-1 if t0[(r - 1) % p] < 0 else (t0[(r - 1) % p] + 1) % p for r in range(p)]
    return t0, [-1 if t0[p - 1 - r] < 0 else p - 1 - t0[p - 1 - r] for r in range(p)]


def trees(p: int) -> tuple[list[int], list[int]]:
    """Parents in our two trees: NCCL's for even p; for odd p, NCCL's over p - 1 ranks with
    rank p - 1 hung under both roots (module docstring: NCCL's odd shift leaves rank 0 interior
    twice).

    Args:
        p: the number of ranks.

    Returns:
        (tree 0's parents, tree 1's parents), -1 at each root.
    """
    if p % 2 == 0 or p == 1:
        return nccl_dtree(p)
    t0, t1 = nccl_dtree(p - 1)
    return [*t0, t0.index(-1)], [*t1, t1.index(-1)]


def roles(p: int) -> list[tuple[str, str]]:
    """Each rank's role in tree 0 and tree 1: 'leaf' (no children) or 'interior' (the root too).

    Args:
        p: the number of ranks.

    Returns:
        One (tree 0 role, tree 1 role) pair per rank.
    """
    kids = [children_of(t) for t in trees(p)]
    return [
        ("interior" if kids[0][r] else "leaf", "interior" if kids[1][r] else "leaf")
        for r in range(p)
    ]


def _check(p: int, k: int) -> None:
    check_pieces(p, k, "double_tree")


def one_tree(p: int, which: int, k: int = 1) -> Schedule:
    """Tree ``which`` alone, reducing and broadcasting its half (chunks which*k .. which*k + k - 1):
    half an all-reduce, for pictures and for reading one tree's rounds.

    Args:
        p: the number of ranks.
        which: 0 or 1.
        k: pieces per tree.

    Returns:
        A schedule of 2k chunks that moves only tree ``which``'s k.

    Raises:
        ConfigError: ``which`` is not 0 or 1, or p, k out of range (``check_pieces``).
    """
    _check(p, k)
    if which not in (0, 1):
        raise ConfigError(f"double_tree has trees 0 and 1, not {which}")
    return over_trees(
        f"double_tree_{which}", p, 2 * k, [(trees(p)[which], range(which * k, which * k + k))]
    )


def allreduce(p: int, k: int = TREE_PIECES) -> Schedule:
    """Both trees at once, each reducing then broadcasting its half of the buffer in ``k``
    pieces.

    Args:
        p: the number of ranks.
        k: pieces per tree (the buffer is cut in 2k chunks).

    Returns:
        The schedule named "double_tree".

    Raises:
        ConfigError: p < 1, or k not between 1 and ``MAX_PIECES``.
    """
    _check(p, k)
    t0, t1 = trees(p)
    return over_trees("double_tree", p, 2 * k, [(t0, range(k)), (t1, range(k, 2 * k))])


def busiest(p: int, n: int, k: int = TREE_PIECES) -> int:
    """The most elements any rank sends for an n-element buffer: tree 0 carries h0 = the first k of
    ``chunk_bounds(n, 2k)`` (the larger half), and rank 2 is interior in it with two children (3 h0)
    and a leaf in tree 1 (h1): n + 2 h0, which is 2n when 2k divides n (p >= 4; p = 3: n + h0).

    Args:
        p: the number of ranks.
        n: elements in the buffer.
        k: pieces per tree.

    Returns:
        Elements sent by the busiest rank.
    """
    base, extra = divmod(n, 2 * k)
    h0 = k * base + min(extra, k)
    return (0, 0, n, n + h0)[p] if p < 4 else n + 2 * h0
