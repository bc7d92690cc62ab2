"""Pipelined all-reduce: cut the buffer into k pieces that flow one behind the other (NCCL).

A rank of height h (a leaf has h = 0) sends piece j up in round h + j; the root starts
broadcasting piece j at once, and a rank at depth d sends it down in round H + d + j:
2H + k - 1 rounds of n/k bytes, so the tree's depth stops multiplying the bytes; each piece
costs an alpha (the best k grows like sqrt(n beta / alpha)). The tree is NCCL's binary tree
(``ncclGetBtree``): odd ranks are leaves, height ceil(lg p). For p = 8, each leaf's path:

    0 <- 4 <- 2 <- 1
    0 <- 4 <- 2 <- 3
    0 <- 4 <- 6 <- 5
    0 <- 4 <- 6 <- 7

The all-reduce for p = 4, k = 2 pieces (a, b): b runs one round behind a:

    round 0 (adds):  1-a->2   3-a->2
    round 1 (adds):  2-a->0   1-b->2   3-b->2
    round 2 (adds/copies):  0-a->2   2-b->0
    round 3 (copies):  2-a->1   2-a->3   0-b->2
    round 4 (copies):  2-b->1   2-b->3

``pipelined_ring``: slice j of ring step s goes in round s + j, 2(p-1) + k - 1 rounds. The
round model prices it at the ring's time plus 2(p-1)(k-1) alpha; ``sliced_ring_time`` prices
what NCCL gains, the reduction hidden behind the wire (reference/README.md, "The algorithms").
p = 3, k = 2 (a b are ring chunk 0's two slices, c d chunk 1's, e f chunk 2's):

    round 0 (adds):  1-a->2   2-c->0   0-e->1
    round 1 (adds):  2-a->0   1-b->2   0-c->1   2-d->0   1-e->2   0-f->1
    round 2 (adds/copies):  0-a->1   2-b->0   1-c->2   0-d->1   2-e->0   1-f->2
    round 3 (copies):  1-a->2   0-b->1   2-c->0   1-d->2   0-e->1   2-f->0
    round 4 (copies):  1-b->2   2-d->0   0-f->1

    ALLREDUCE["pipelined_tree"](8, 4)      # or allreduce_schedule("pipelined_tree:4", 8)
"""

from __future__ import annotations

from collections.abc import Sequence

from dplab.reference.algorithms.ring import allgather as ring_allgather
from dplab.reference.algorithms.ring import reduce_scatter as ring_reduce_scatter
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, Transfer

__all__ = ["TREE_PIECES", "RING_SLICES", "MAX_PIECES", "check_pieces", "btree", "children_of",
           "heights", "depths", "over_trees", "pipelined_tree", "pipelined_ring", "tree_busiest",
           "ring_busiest", "sliced_ring_time"]

# default pieces per tree: the model's best k at 1 MiB for double_tree at p = 64 (module doc)
TREE_PIECES = 8
# default slices per ring step: buys nothing in the round model, hides gamma in real links
RING_SLICES = 4
# The most pieces a pipeline takes. The best k grows like sqrt(n beta / alpha): about 150 for
# 1 GiB on a 10 GB/s link with 5 us per message; beyond a thousand each piece is mostly alpha,
# and a pipelined ring of 64 ranks is already 8 M transfers to build.
MAX_PIECES = 1024


def check_pieces(p: int, k: int, name: str) -> None:
    """ConfigError unless p >= 1 and 1 <= k <= ``MAX_PIECES``: every pipelined builder, readable
    or arrays (``backends/fastpath/arrays.py``), checks with this one function.

    Args:
        p: the number of ranks.
        k: the piece count.
        name: the algorithm, for the message.

    Raises:
        ConfigError: p < 1, or k outside 1..``MAX_PIECES``.
    """
    if p < 1 or not 1 <= k <= MAX_PIECES:
        raise ConfigError(f"{name}: world_size must be >= 1 and the piece count between 1 and "
                          f"{MAX_PIECES}, got p={p}, k={k} (write e.g. '{name}:4')")


def btree(p: int) -> list[int]:
    """Each rank's parent in NCCL's binary tree over ``p`` ranks (root 0: -1), as ncclGetBtree
    builds it.

    Rank r's lowest set bit b: its parent is r with b cleared and 2b set (r ^ b | 2b), or r ^ b
    when that is out of range; so 1, 3 hang under 2, 2 and 6 under 4, and the largest power of
    two below p under 0.

    Args:
        p: the number of ranks.

    Returns:
        Each rank's parent, -1 at the root.
    """
    parents = [-1] * p
    for r in range(1, p):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parents[r] = up if up < p else r ^ bit
    return parents


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Each rank's children, in rank order.

    Args:
        parents: each rank's parent, -1 at a root.

    Returns:
        Each rank's list of children.
    """
    kids: list[list[int]] = [[] for _ in parents]
    for r, q in enumerate(parents):
        if q >= 0:
            kids[q].append(r)
    return kids


def heights(parents: Sequence[int]) -> list[int]:
    """Each rank's height: 0 for a leaf, 1 + its tallest child's otherwise.

    Args:
        parents: each rank's parent, -1 at a root.

    Returns:
        Each rank's height.
    """
    kids, h = children_of(parents), [0] * len(parents)

    def walk(r: int) -> int:  # depth is at most ~lg p + 1: recursion is fine
        h[r] = max((walk(c) + 1 for c in kids[r]), default=0)
        return h[r]

    for root in (r for r, q in enumerate(parents) if q < 0):
        walk(root)
    return h


def depths(parents: Sequence[int]) -> list[int]:
    """Each rank's distance from its root.

    Args:
        parents: each rank's parent, -1 at a root.

    Returns:
        Each rank's depth (0 at a root).
    """
    d = [0] * len(parents)
    for r in range(len(parents)):
        q = parents[r]
        while q >= 0:
            d[r], q = d[r] + 1, parents[q]
    return d


def _by_chunk(timed: dict[int, list[Transfer]]) -> tuple[tuple[Transfer, ...], ...]:
    """Rounds 0..last, each round's transfers grouped by chunk (the order the app draws them in)."""
    last = max(timed, default=-1)
    return tuple(tuple(sorted(timed.get(i, ()), key=lambda t: t.chunk)) for i in range(last + 1))


def over_trees(
    name: str, p: int, num_chunks: int, trees: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> Schedule:
    """All-reduce over one or more trees at once: ``trees`` is (parents, chunks) pairs, each tree
    reducing its chunks (pieces, in pipeline order) up to its root and broadcasting them back.

    Rank r of height h sends piece j up in round h + j; at depth d it sends piece j down in
    round H + d + j (H: the tree's height). A rank never sends a piece it receives in the same
    round: pieces move up one level per round, so what arrives in a round is a later piece.

    Args:
        name: the schedule's name.
        p: the number of ranks.
        num_chunks: chunks the buffer is cut into (every tree's chunks among them).
        trees: (parents, chunks) per tree.

    Returns:
        The schedule, each round's transfers ordered by chunk.
    """
    timed: dict[int, list[Transfer]] = {}
    for parents, chunks in trees:
        h, d = heights(parents), depths(parents)
        height = max(h, default=0)
        for r, q in enumerate(parents):
            if q < 0:
                continue
            for j, c in enumerate(chunks):
                timed.setdefault(h[r] + j, []).append(Transfer(r, q, c, "reduce"))
                timed.setdefault(height + d[q] + j, []).append(Transfer(q, r, c, "copy"))
    return Schedule(name, p, num_chunks, _by_chunk(timed))


def pipelined_tree(p: int, k: int = TREE_PIECES) -> Schedule:
    """All-reduce over NCCL's binary tree, the buffer in ``k`` pieces:
    2 ceil(lg p) + k - 1 rounds.

    Args:
        p: the number of ranks.
        k: pieces the buffer is cut into.

    Returns:
        The schedule named "pipelined_tree" of k chunks.

    Raises:
        ConfigError: p < 1, or k not between 1 and ``MAX_PIECES``.
    """
    check_pieces(p, k, "pipelined_tree")
    return over_trees("pipelined_tree", p, k, [(btree(p), range(k))])


def pipelined_ring(p: int, k: int = RING_SLICES) -> Schedule:
    """The ring all-reduce with each step cut into ``k`` slices, slice j one round behind slice j-1:
    ring chunk c is chunks c k .. c k + k - 1, and slice j of ring step s goes in round s + j.

    Args:
        p: the number of ranks.
        k: slices per ring chunk.

    Returns:
        The schedule named "pipelined_ring" of p k chunks, 2(p - 1) + k - 1 rounds.

    Raises:
        ConfigError: p < 1, or k not between 1 and ``MAX_PIECES``.
    """
    check_pieces(p, k, "pipelined_ring")
    steps = ring_reduce_scatter(p).rounds + ring_allgather(p).rounds
    timed: dict[int, list[Transfer]] = {}
    for s, step in enumerate(steps):
        for j in range(k):
            timed.setdefault(s + j, []).extend(
                Transfer(t.src, t.dst, t.chunk * k + j, t.op) for t in step
            )
    return Schedule("pipelined_ring", p, p * k, _by_chunk(timed))


def tree_busiest(p: int, n: int) -> int:
    """The most elements any rank sends in ``pipelined_tree`` for an n-element buffer, any k: every
    piece goes once up and once down each edge, so an interior rank with two children sends 3n.

    Args:
        p: the number of ranks.
        n: elements in the buffer.

    Returns:
        Elements sent by the busiest rank.
    """
    return n * (0, 0, 1, 2)[p] if p < 4 else 3 * n


def ring_busiest(p: int, n: int, k: int = RING_SLICES) -> int:
    """The most elements any rank sends in ``pipelined_ring``: rank r sends every ring chunk but r
    (reduce-scatter) and every one but r + 1 (all-gather); ring chunk c is chunks ck..ck+k-1 of
    ``chunk_bounds(n, pk)``, larger first, so the busiest skips the last two:
    2(p-1)/p n when pk | n.

    Args:
        p: the number of ranks.
        n: elements in the buffer.
        k: slices per ring chunk.

    Returns:
        Elements sent by the busiest rank.
    """
    if p == 1:
        return 0
    base, extra = divmod(n, p * k)
    size = [k * base + min(max(extra - c * k, 0), k) for c in range(p)]
    return 2 * n - size[-1] - size[-2]


def sliced_ring_time(
    p: int, nbytes: float, alpha: float, beta: float, gamma: float, k: int
) -> float:
    """The ring's time when a rank forwards each slice as soon as it is reduced (outside the round
    model).

    One rank's link sends slices one after another (alpha + m beta each, m = n/(pk)); its adder
    reduces what arrived one slice at a time (m gamma), overlapping the link. Slice j of step
    s + 1 leaves once slice j of step s has been reduced (reduce-scatter) or arrived
    (all-gather). Every rank does the same at the same times, so one rank's timeline is the
    ring's. k = 1 gives exactly the round model's ring time.

    Args:
        p: the number of ranks.
        nbytes: the buffer's size in bytes.
        alpha: seconds per message.
        beta: seconds per byte sent.
        gamma: seconds per byte reduced.
        k: slices per ring chunk.

    Returns:
        Seconds for the whole all-reduce.

    Raises:
        ConfigError: p < 1, or k not between 1 and ``MAX_PIECES``.
    """
    check_pieces(p, k, "sliced_ring_time")
    if p == 1:
        return 0.0
    send, add = alpha + beta * nbytes / (p * k), gamma * nbytes / (p * k)
    ready, link, adder = [0.0] * k, 0.0, 0.0
    for s in range(2 * (p - 1)):
        for j in range(k):
            link = max(link, ready[j]) + send
            if s < p - 1:
                adder = max(adder, link) + add
                ready[j] = adder
            else:
                ready[j] = link
    return max(ready)
