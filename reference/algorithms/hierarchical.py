"""Hierarchical (two-level) all-reduce: inside each node, then across nodes, then inside again.

Nodes are g consecutive ranks (``"hierarchical:<g>"``), N = ceil(p / g) of them. On several
hosts ``"hierarchical"`` means g = ranks per host (``comm.hosts``) and another g is refused;
on one host the nodes are simulated, ``NODE_SIZE`` by default (``layout.py`` resolves the name).
The buffer is cut into g pieces of N sub-chunks (chunk c N + j is sub-chunk j of piece c):

1. reduce-scatter inside each node (a ring): local rank i ends with piece i of its node's sum;
2. all-reduce across nodes, one ring per piece, all g rings at once, each on its own link;
3. all-gather inside each node (a ring).

Each rank sends 2(p-1)/p n bytes, as the ring, but only a g-th of it across nodes, in
2(g-1) + 2(N-1) rounds. g = 1 and g >= p are the plain ring. A smaller last node (s = p mod g
ranks): its local rank i holds every piece c with c mod s = i and runs those rings at once.
p = 4, g = 2 (nodes {0, 1} and {2, 3}; piece 0 is chunks a b, piece 1 is c d):

    p = 4, chunks a b c d; "a01" holds rank 0's and rank 1's parts of chunk a
    --x--> the receiver adds x, ==x==> it copies x
    round 0
      r0 [a0 b0 c0 d0]  --c0--> r1  --d0--> r1
      r1 [a1 b1 c1 d1]  --a1--> r0  --b1--> r0
      r2 [a2 b2 c2 d2]  --c2--> r3  --d2--> r3
      r3 [a3 b3 c3 d3]  --a3--> r2  --b3--> r2
    round 1
      r0 [a01 b01 c0  d0]   --b01--> r2
      r1 [a1  b1  c01 d01]  --d01--> r3
      r2 [a23 b23 c2  d2]   --a23--> r0
      r3 [a3  b3  c23 d23]  --c23--> r1
    round 2
      r0 [a0123 b01   c0    d0]     ==a0123==> r2
      r1 [a1    b1    c0123 d01]    ==c0123==> r3
      r2 [a23   b0123 c2    d2]     ==b0123==> r0
      r3 [a3    b3    c23   d0123]  ==d0123==> r1
    round 3
      r0 [a0123 b0123 c0    d0]     ==a0123==> r1  ==b0123==> r1
      r1 [a1    b1    c0123 d0123]  ==c0123==> r0  ==d0123==> r0
      r2 [a0123 b0123 c2    d2]     ==a0123==> r3  ==b0123==> r3
      r3 [a3    b3    c0123 d0123]  ==c0123==> r2  ==d0123==> r2
    after round 3
      r0 [a0123 b0123 c0123 d0123]
      r1 [a0123 b0123 c0123 d0123]
      r2 [a0123 b0123 c0123 d0123]
      r3 [a0123 b0123 c0123 d0123]

Rounds 0 and 3 are inside the nodes, 1 and 2 the rings across them.
"""

from __future__ import annotations

from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Op, Schedule, Transfer

__all__ = ["allreduce", "NODE_SIZE", "MAX_NODE_SIZE", "layout"]

NODE_SIZE = 2  # the default g: at the small world sizes tests run, two levels show up from p = 3
MAX_NODE_SIZE = 4096  # the largest g taken: the largest world the cost model prices (g >= p: ring)


def layout(p: int, g: int) -> tuple[int, int, list[int]]:
    """(g, N, node sizes) with g clipped to p: g ranks per node, the last node possibly smaller.

    Args:
        p: the number of ranks.
        g: ranks per node asked for.

    Returns:
        (g, N, sizes): g clipped to p, the number of nodes N, and each node's size.

    Raises:
        ConfigError: ``g`` is not between 1 and ``MAX_NODE_SIZE``.
    """
    if not 1 <= g <= MAX_NODE_SIZE:
        raise ConfigError(f"hierarchical:{g}: a node holds between 1 and {MAX_NODE_SIZE} ranks")
    g = min(g, p)
    n = -(-p // g)
    return g, n, [min(g, p - x * g) for x in range(n)]


def _intra(g: int, n: int, sizes: list[int], k: int, shift: int, op: Op) -> tuple[Transfer, ...]:
    """Round k of a ring inside every node of s ranks: local rank i sends local rank i + 1 the
    pieces c with c mod s = (i - k - shift) mod s (one piece in a full node), all N sub-chunks of
    each (one message: sub-chunks c N .. c N + N - 1 are consecutive)."""
    return tuple(Transfer(x * g + i, x * g + (i + 1) % s, c * n + j, op)
                 for x, s in enumerate(sizes) if k < s - 1 for i in range(s)
                 for c in range(g) if c % s == (i - k - shift) % s for j in range(n))


def _inter(g: int, n: int, sizes: list[int], k: int, shift: int, op: Op) -> tuple[Transfer, ...]:
    """Round k of the g rings across nodes: on piece c's ring, node x's holder of c (its local rank
    c mod s) sends sub-chunk (x - k - shift) mod N to node x + 1's holder."""
    def holder(x: int, c: int) -> int:
        return x * g + c % sizes[x]

    return tuple(Transfer(holder(x, c), holder((x + 1) % n, c), c * n + (x - k - shift) % n, op)
                 for c in range(g) for x in range(n))


def allreduce(p: int, g: int = NODE_SIZE) -> Schedule:
    """The two-level all-reduce: a ring inside each node, g rings across nodes, then back.

    Args:
        p: the number of ranks, consecutive ranks sharing a node.
        g: ranks per node (clipped to p; the last node may be smaller).

    Returns:
        The schedule named "hierarchical" over g N chunks: only a g-th of the bytes crosses nodes.

    Raises:
        ConfigError: ``g`` is not between 1 and ``MAX_NODE_SIZE``.
    """
    g, n, sizes = layout(p, g)
    rounds = [_intra(g, n, sizes, k, 1, "reduce") for k in range(g - 1)]
    rounds += [_inter(g, n, sizes, k, 1, "reduce") for k in range(n - 1)]
    rounds += [_inter(g, n, sizes, k, 0, "copy") for k in range(n - 1)]
    rounds += [_intra(g, n, sizes, k, 0, "copy") for k in range(g - 1)]
    return Schedule("hierarchical", p, g * n, rounds)
