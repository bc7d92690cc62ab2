"""Solution (lesson 10): one ZeRO-2 step.

reduce-scatter the gradient (rank r's chunk r now holds the sum), step the optimizer on the
chunk this rank owns, all-gather the parameters. The engine's, one layer at a time and
overlapped with backward: dplab/reference/zero/grads.py (ShardedGrads) and params.py.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allgather, reduce_scatter
from dplab.reference.schedule import chunk_bounds


def zero2_step(comm, params: np.ndarray, grad: np.ndarray, optimizer) -> None:
    a, b = chunk_bounds(len(params), comm.world_size)[comm.rank]  # the chunk this rank owns
    reduce_scatter(comm, grad)  # grad[a:b] is now the sum over all ranks
    optimizer.step(params[a:b], grad[a:b])  # only this rank's chunk, in place
    allgather(comm, params)  # every rank gets every owner's updated chunk
