"""Solution (lesson 10): an FSDP unit's gather and free.

The engine's, with prefetching and a flat parameter per unit: dplab/reference/zero/params.py
(stage 3's acquire and release) and dplab/backends/nn/fsdp_units.py for torch modules.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allgather, reduce_scatter
from dplab.reference.schedule import chunk_bounds


def gather(comm, shard: np.ndarray, n: int) -> np.ndarray:
    """The unit's whole weights on every rank, from every rank's chunk."""
    a, b = chunk_bounds(n, comm.world_size)[comm.rank]
    w = np.empty(n, dtype=shard.dtype)
    w[a:b] = shard  # my chunk in its place; the all-gather fills the others'
    allgather(comm, w)
    return w


def unit_forward(comm, shard: np.ndarray, n: int, forward):
    return forward(gather(comm, shard, n))  # the gathered weights go when forward returns


def unit_backward(comm, shard: np.ndarray, n: int, backward, grad_shard: np.ndarray) -> None:
    g = backward(gather(comm, shard, n))  # gathered again: forward freed them
    reduce_scatter(comm, g)  # my chunk of g is now the sum over the ranks
    a, b = chunk_bounds(n, comm.world_size)[comm.rank]
    grad_shard[:] = g[a:b]  # a copy: g itself goes on return
