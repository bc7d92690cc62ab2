"""Exercise (lesson 10): clip the gradient by its GLOBAL norm when every rank holds a shard.

Training recipes clip the gradient g before the optimizer steps:
torch.nn.utils.clip_grad_norm_(params, max_norm) scales ALL of g by

    coef = min(1, max_norm / (||g|| + 1e-6))          ||g||: the norm of the WHOLE gradient

Under ZeRO-2 and FSDP no rank holds the whole gradient: after each layer's reduce-scatter,
rank r holds chunk r of every layer's summed gradient, shard[layer]. Every rank must still
scale its chunks by the SAME coef, the one the whole gradient has.

Write ``sharded_clip(comm, backward, shard, max_norm)``, run on every rank once a step:

    backward   `for layer, g in backward:` gives each layer's gradient of this rank's
               samples, LAST layer first (the loop below already reduce-scatters each one and
               keeps this rank's chunk in shard[layer]: lesson 10's ZeRO-2)
    shard      shard[layer]: this rank's chunk of the layer's summed gradient; clip it in place
    max_norm   the largest norm the whole gradient may keep

and return the global norm ||g|| before clipping (the same on every rank), as torch does.
The check runs it on 1..3 ranks and holds every chunk, and the norm you return, to
torch.nn.utils.clip_grad_norm_ on one device with the whole gradient.

The body below clips each shard by ITS OWN norm. Fix it:

    dplab lesson check 10 DIR
"""

from __future__ import annotations

import math

import numpy as np  # noqa: F401 (yours to use)

from dplab.reference.collectives import allreduce, reduce_scatter  # noqa: F401 (allreduce: yours)
from dplab.reference.schedule import chunk_bounds


def sharded_clip(comm, backward, shard, max_norm) -> float:
    p, rank = comm.world_size, comm.rank
    for layer, g in backward:
        reduce_scatter(comm, g)  # chunk `rank` of g now holds the sum over all ranks
        a, b = chunk_bounds(len(g), p)[rank]
        shard[layer][:] = g[a:b]
        del g
    # TODO: the norm of the WHOLE gradient; this is the norm of this rank's chunks alone
    norm = math.sqrt(sum(float(s @ s) for s in shard))
    coef = min(1.0, max_norm / (norm + 1e-6))
    for s in shard:
        s *= coef
    return norm
