"""The schedules built as arrays, one ``Round`` per round, to price p = 4096: the same schedules as
the readable builders of ``dplab.reference.algorithms`` (the source), row for row
(``tests/test_spine_equals_engine.py``). Transfer by Transfer, the ring at p = 4096 is 33.5 M
objects (minutes and gigabytes); as arrays it is built in a second or two.

    from dplab.backends.fastpath.arrays import ALLREDUCE
    ALLREDUCE["ring"](4096)               # equal to dplab.reference.algorithms.ring.allreduce(4096)
    best_regions(topology, ps, sizes, builders=ALLREDUCE)   # the cost model at large p

Each builder takes the readable one's arguments ((p) or (p, param)) and lists every round's
transfers in the readable builder's order: the order the executor posts a rank's messages in.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.algorithms.hierarchical import layout
from dplab.reference.algorithms.pipelined import check_pieces
from dplab.reference.algorithms.recursive_doubling import fold
from dplab.reference.columns import Round, RoundTable
from dplab.reference.schedule import Op

__all__ = ["ALLREDUCE", "SCATTER"]


# -- Rabenseifner: recursive halving, then doubling (chunk by chunk, senders in rank order) --------

def _owners(start: np.ndarray) -> np.ndarray:
    """The virtual rank that owns each chunk (``start[v]`` is virtual rank v's first chunk)."""
    return np.repeat(np.arange(len(start) - 1), np.diff(start))


def _round(real: np.ndarray, start: np.ndarray, d: int, base: np.ndarray, op: Op) -> Round:
    """Chunk c goes from the d virtual ranks ``base[owner(c)] + 0..d-1`` to each one's partner v ^ d
    (chunk by chunk, senders in rank order: ``real`` is increasing)."""
    chunks = np.arange(int(start[-1]))
    v = np.repeat(base[_owners(start)], d) + np.tile(np.arange(d), chunks.size)
    return Round(real[v], real[v ^ d], np.repeat(chunks, d), op)


def _halving(pof2: int, real: np.ndarray, start: np.ndarray) -> list[Round]:
    """Recursive halving among the p' virtual ranks: partners d apart, each sends the half of its
    group its partner keeps, so chunk c of virtual rank w comes from the d ranks whose partners
    share w's aligned block of d: ``(w & ~(d-1)) ^ d`` and up."""
    w = np.arange(pof2)
    ds = [pof2 >> i for i in range(1, pof2.bit_length())]  # p'/2, p'/4, ..., 1
    return [_round(real, start, d, (w & ~(d - 1)) ^ d, "reduce") for d in ds]


def _doubling(pof2: int, real: np.ndarray, start: np.ndarray) -> list[Round]:
    """Recursive doubling among the virtual ranks: send everything gathered so far, i.e. the
    chunks of one's own aligned block of d, so chunk c of w comes from that block's d ranks."""
    w = np.arange(pof2)
    ds = [1 << i for i in range(pof2.bit_length() - 1)]  # 1, 2, ..., p'/2
    return [_round(real, start, d, w & ~(d - 1), "copy") for d in ds]


def _whole(rem: int, chunks: int, op: Op, down: bool, skip_own: bool = False) -> Round:
    """The fold: odd rank 2i+1 hands chunks 0..chunks-1 to 2i (``down``), or 2i hands them back
    (``skip_own``: all but chunk 2i+1, which the partner already has). Chunk by chunk, i inside."""
    c, i = np.repeat(np.arange(chunks), rem), np.tile(np.arange(rem), chunks)
    if skip_own:
        c, i = c[c != 2 * i + 1], i[c != 2 * i + 1]
    return Round(2 * i + 1, 2 * i, c, op) if down else Round(2 * i, 2 * i + 1, c, op)


def _setup(p: int, pairs_own_two: bool) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(p', rem, real rank of each virtual rank, each virtual rank's first chunk and the end):
    with ``pairs_own_two`` virtual rank v < rem owns chunks 2v, 2v+1 (its real pair's), the
    others one each (p chunks: the reduce-scatter's layout); else v owns chunk v (p' chunks)."""
    pof2, rem, real = fold(p)
    owned = 1 + (np.arange(pof2) < rem) * pairs_own_two
    return pof2, rem, np.asarray(real, np.int64), np.concatenate(([0], np.cumsum(owned)))


def rabenseifner_reduce_scatter(p: int) -> RoundTable:
    pof2, rem, real, start = _setup(p, pairs_own_two=True)
    rounds = [_whole(rem, p, "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start)
    if rem:
        i = np.arange(rem)
        rounds.append(Round(2 * i, 2 * i + 1, 2 * i + 1, "copy"))
    return RoundTable.build("rabenseifner_reduce_scatter", p, p, rounds)


def rabenseifner_allgather(p: int) -> RoundTable:
    pof2, rem, real, start = _setup(p, pairs_own_two=True)
    i = np.arange(rem)
    rounds = [Round(2 * i + 1, 2 * i, 2 * i + 1, "copy")] if rem else []
    rounds += _doubling(pof2, real, start)
    if rem:  # everything but the partner's own chunk
        rounds.append(_whole(rem, p, "copy", down=False, skip_own=True))
    return RoundTable.build("rabenseifner_allgather", p, p, rounds)


def rabenseifner_allreduce(p: int) -> RoundTable:
    pof2, rem, real, start = _setup(p, pairs_own_two=False)  # p' even chunks, v owns chunk v
    rounds = [_whole(rem, pof2, "reduce", down=True)] if rem else []
    rounds += _halving(pof2, real, start) + _doubling(pof2, real, start)
    if rem:
        rounds.append(_whole(rem, pof2, "copy", down=False))
    return RoundTable.build("rabenseifner", p, pof2, rounds)


# -- the ring: round k is one line, every rank at once --------------------------------------------

def ring_reduce_scatter(p: int) -> RoundTable:
    r = np.arange(p)
    return RoundTable.build("ring_reduce_scatter", p, p,
                            [Round(r, (r + 1) % p, (r - k - 1) % p, "reduce")
                                                          for k in range(p - 1)])


def ring_allgather(p: int) -> RoundTable:
    r = np.arange(p)
    return RoundTable.build("ring_allgather", p, p, [Round(r, (r + 1) % p, (r - k) % p, "copy")
                                                     for k in range(p - 1)])


def ring_allreduce(p: int) -> RoundTable:
    return RoundTable.concat("ring", ring_reduce_scatter(p), ring_allgather(p))


# -- direct: one round each way, every chunk straight to its owner ---------------------------------

def _pairs(p: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, r) for every d, then every r != d: the order the transfers are listed in."""
    d, r = np.divmod(np.arange(p * p, dtype=np.int32), p)
    keep = r != d
    return d[keep], r[keep]


def direct_reduce_scatter(p: int) -> RoundTable:
    d, r = _pairs(p)  # rank r sends chunk d to its owner d
    return RoundTable.build("direct_reduce_scatter", p, p,
                            [Round(r, d, d, "reduce")] if p > 1 else [])


def direct_allgather(p: int) -> RoundTable:
    d, r = _pairs(p)  # owner d sends its chunk d to every r
    return RoundTable.build("direct_allgather", p, p, [Round(d, r, d, "copy")] if p > 1 else [])


def direct_allreduce(p: int) -> RoundTable:
    return RoundTable.concat("direct", direct_reduce_scatter(p), direct_allgather(p))


# -- the pipelined ring: slice j of ring step s in round s + j -------------------------------------

def pipelined_ring(p: int, k: int) -> RoundTable:
    """Round i carries slice j = i - s of ring step s for every step s in flight; in chunk order
    (ring chunk c, then slice j), the sender of ring chunk c in step s is rank c + s + 1 in the
    reduce-scatter (s < p - 1) and c + s - (p - 1) in the all-gather (the ring's formulas solved
    for the rank), always to its right neighbour."""
    check_pieces(p, k, "pipelined_ring")
    steps = 2 * (p - 1)
    rounds = []
    for i in range(steps + k - 1 if p > 1 else 0):
        js = np.arange(max(0, i - steps + 1), min(i, k - 1) + 1)  # the slices in flight
        c, j = np.repeat(np.arange(p), js.size), np.tile(js, p)
        s = i - j
        gather = s >= p - 1
        src = (c + s + 1 - gather * p) % p
        mixed = gather[0] != gather[-1]  # only the k - 1 rounds where the two phases meet
        op = np.where(gather, "copy", "reduce") if mixed else ("copy" if gather[0] else "reduce")
        rounds.append(Round(src, (src + 1) % p, c * k + j, op))
    return RoundTable.build("pipelined_ring", p, p * k, rounds)


# -- hierarchical: rings inside the nodes, g rings across them -------------------------------------

def _intra(g: int, n: int, sizes: list[int], k: int, shift: int, op: Op) -> Round:
    """Round k of a ring inside every node: local rank i sends the pieces c with c mod s = (i - k
    - shift) mod s (s its node's size; c = that one in a full node), all N sub-chunks of each (one
    message: sub-chunks c N .. c N + N - 1 are consecutive), to local rank i + 1."""
    full = sum(1 for s in sizes if s == g) if g > 1 and k < g - 1 else 0
    r = np.arange(full * g)
    i = r % g
    parts = [(np.repeat(r, n), np.repeat(r - i + (i + 1) % g, n),
              np.repeat((i - k - shift) % g * n, n) + np.tile(np.arange(n), r.size))]
    s = sizes[-1]
    if s < g and k < s - 1:  # the smaller last node: each rank sends all the pieces it holds
        base = (len(sizes) - 1) * g
        for i in range(s):
            pieces = [c for c in range(g) if c % s == (i - k - shift) % s]
            chunks = np.concatenate([c * n + np.arange(n) for c in pieces])
            parts.append((np.full(chunks.size, base + i), np.full(chunks.size, base + (i + 1) % s),
                          chunks))
    return Round(*(np.concatenate(cols) for cols in zip(*parts)), op)


def _inter(g: int, n: int, sizes: list[int], k: int, shift: int, op: Op) -> Round:
    """Round k of the g rings across nodes: on piece c's ring, node x's holder sends sub-chunk
    (x - k - shift) mod N to node x + 1's holder."""
    c, x = np.meshgrid(np.arange(g), np.arange(n), indexing="ij")  # (piece, node)
    size = np.asarray(sizes)[x]
    holder = x * g + c % size
    nxt = (x + 1) % n
    to = nxt * g + c % np.asarray(sizes)[nxt]
    sub = (x - k - shift) % n
    return Round(holder.ravel(), to.ravel(), (c * n + sub).ravel(), op)


def hierarchical(p: int, g: int) -> RoundTable:
    g, n, sizes = layout(p, g)
    rounds = [_intra(g, n, sizes, k, 1, "reduce") for k in range(g - 1)]
    rounds += [_inter(g, n, sizes, k, 1, "reduce") for k in range(n - 1)]
    rounds += [_inter(g, n, sizes, k, 0, "copy") for k in range(n - 1)]
    rounds += [_intra(g, n, sizes, k, 0, "copy") for k in range(g - 1)]
    return RoundTable.build("hierarchical", p, g * n, rounds)


# The registry's names, for the algorithms whose schedules grow like p^2 (or p^2 k): the others
# (tree, naive, recursive doubling, the pipelined trees) are O(p lg p) transfers, readable at 4096.
ALLREDUCE = {"ring": ring_allreduce, "direct": direct_allreduce,
             "rabenseifner": rabenseifner_allreduce,
             "pipelined_ring": pipelined_ring, "hierarchical": hierarchical}
SCATTER = {"ring": (ring_reduce_scatter, ring_allgather),
           "direct": (direct_reduce_scatter, direct_allgather),
           "rabenseifner": (rabenseifner_reduce_scatter, rabenseifner_allgather)}
