"""Exercise (lesson 10): one optimizer step of ZeRO stage 2.

Plain data parallelism keeps on every rank the whole gradient and the whole optimizer state.
ZeRO-2 shards both: the flat parameter vector is cut into p chunks, ``chunk_bounds(n, p)``, and
rank r OWNS chunk r. It keeps optimizer state for its chunk only, and needs only its chunk of
the summed gradient.

Write ``zero2_step(comm, params, grad, optimizer)``, run on every rank after its backward pass:

    params     the whole flat parameter vector (every rank holds all of it, to compute with)
    grad       this rank's gradient of ITS shard of the batch, the whole vector (scratch: yours)
    optimizer  holds state for this rank's chunk only: optimizer.step(params_chunk, grad_chunk)
               updates params_chunk in place (give it views: params[a:b], grad[a:b])

Three moves: sum the gradients so that rank r holds chunk r of the sum (reduce_scatter), update
the chunk this rank owns, and give every rank every updated chunk (allgather). The collectives
(dplab/reference/collectives.py) run in place on every rank. Each rank's loss is already scaled
by 1/global batch: the ranks' gradients SUM to the one-device gradient.

The body below is plain data parallelism. Turn it into ZeRO-2.

Check it (1..4 ranks, every rank's every chunk against one device after every step):

    dplab lesson check 10 DIR
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allgather, allreduce, reduce_scatter  # noqa: F401 (yours to use)
from dplab.reference.schedule import chunk_bounds  # noqa: F401 (yours to use)


def zero2_step(comm, params: np.ndarray, grad: np.ndarray, optimizer) -> None:
    allreduce(comm, grad)  # every rank gets the whole summed gradient...
    optimizer.step(params, grad)  # ...and updates every parameter
