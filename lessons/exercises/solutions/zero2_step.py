"""Solution (lesson 10): one ZeRO-2 step, reduce-scattering each layer during backward.

The engine's, with the reduce-scatter on a communication thread so that it overlaps the next
layer's backward: dplab/reference/zero/grads.py (ShardedGrads) and params.py.
"""

from __future__ import annotations

from dplab.reference.collectives import allgather, reduce_scatter
from dplab.reference.schedule import chunk_bounds


def zero2_step(comm, backward, params, shard, optimizer) -> None:
    p, rank = comm.world_size, comm.rank
    for layer, g in backward:  # last layer first, as backward makes them
        reduce_scatter(comm, g)  # chunk `rank` of g is now the sum over all ranks
        a, b = chunk_bounds(len(g), p)[rank]
        shard[layer][:] = g[a:b]  # a copy: the buffer itself can go
        del g  # before backward makes the next layer's buffer
    for layer, w in enumerate(params):
        a, b = chunk_bounds(len(w), p)[rank]
        optimizer.step(layer, w[a:b], shard[layer])  # only this rank's chunk, in place
        allgather(comm, w)  # every rank gets every owner's updated chunk
