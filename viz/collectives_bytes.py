"""The textbook count of bytes the busiest rank sends in each collective: what the Collectives
page's walk of the real schedule is shown next to (and tested against).

    closed_form_bytes("allreduce", "ring", 4, nbytes=384)   # 2 (p-1)/p n bytes: 576
"""

from __future__ import annotations

import math

from dplab.reference.algorithms import PARAMETRIC, double_tree, pipelined, split_name

__all__ = ["closed_form_bytes"]


def closed_form_bytes(
    collective: str, algorithm: str, world_size: int, nbytes: int, itemsize: int = 4
) -> int | None:
    """The textbook count of bytes the busiest rank sends (n divisible by p): what the walk is
    compared with; None where there is none (hierarchical with a smaller last node). Ring/direct
    move (p-1)/p of the buffer per half; a tree's root sends it once per level; a naive root once
    per other rank; recursive doubling the whole buffer per round, Rabenseifner the ring's bytes,
    each + the whole buffer again where p is not a power of two."""
    p, n = world_size, nbytes
    if p == 1:
        return 0
    if algorithm.partition(":")[0] == "hierarchical":  # the ring's bytes, when nodes are equal
        g = min(split_name(algorithm)[1] or PARAMETRIC["hierarchical"], p)
        return 2 * (p - 1) * n // p if p % g == 0 else None
    lg = math.ceil(math.log2(p))
    m = p.bit_length() - 1  # the fold leaves q = 2^m ranks; rem of them took a partner's part
    q, fold = 1 << m, p > 1 << m
    # rank 0's doubling, in chunks
    gathered = sum(d + min(d, p - q) for d in (1 << i for i in range(m)))
    per_algorithm = {
        "allreduce": {"ring": 2 * (p - 1) * n // p, "direct": 2 * (p - 1) * n // p, "tree": lg * n,
                      "naive": (p - 1) * n, "recursive_doubling": (m + fold) * n,
                      "rabenseifner": 2 * (q - 1) * n // q + fold * n,
                      "pipelined_tree": pipelined.tree_busiest(p, n),  # 3n, any n
                      "pipelined_ring": pipelined.ring_busiest(p, n // itemsize) * itemsize,
                      "double_tree": double_tree.busiest(p, n // itemsize) * itemsize},  # 2n
        "reduce_scatter": {"ring": (p - 1) * n // p, "direct": (p - 1) * n // p,
                           # the fold sends it all
                           "rabenseifner": n if fold else (p - 1) * n // p},
        "allgather": {"ring": (p - 1) * n // p, "direct": (p - 1) * n // p,
                      "rabenseifner": (gathered + fold * (p - 1)) * n // p},
        "broadcast": {"tree": lg * n, "naive": (p - 1) * n},
        "reduce": {"tree": n, "naive": n},
    }
    return per_algorithm[collective][algorithm]
