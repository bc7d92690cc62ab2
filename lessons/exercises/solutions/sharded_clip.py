"""Solution (lesson 10): clip by the global norm, from one all-reduce of the squared shard norms.

The engine's: dplab/reference/zero/clip.py (clip_grad_norm).
"""

from __future__ import annotations

import math

import numpy as np

from dplab.reference.collectives import allreduce, reduce_scatter
from dplab.reference.schedule import chunk_bounds


def sharded_clip(comm, backward, shard, max_norm) -> float:
    p, rank = comm.world_size, comm.rank
    for layer, g in backward:
        reduce_scatter(comm, g)
        a, b = chunk_bounds(len(g), p)[rank]
        shard[layer][:] = g[a:b]
        del g
    # after every reduce-scatter: squares add over disjoint chunks, norms do not
    squares = np.array([sum(float(s @ s) for s in shard)])
    allreduce(comm, squares)  # a sum, not a mean: ||g||^2 = sum over ranks of ||g_r||^2
    norm = math.sqrt(squares[0])
    coef = min(1.0, max_norm / (norm + 1e-6))
    for s in shard:
        s *= coef
    return norm
