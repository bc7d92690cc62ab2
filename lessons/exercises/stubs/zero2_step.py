"""Exercise (lesson 10): one step of ZeRO stage 2, during backward.

Plain data parallelism keeps on every rank the whole gradient and the whole optimizer state.
ZeRO-2 shards both: each layer's flat weights w are cut into p chunks, chunk_bounds(len(w), p),
and rank r OWNS chunk r of every layer. It keeps optimizer state for its chunks only, and needs
only its chunk of each layer's SUMMED gradient, so it never has to hold a whole gradient.

Write ``zero2_step(comm, backward, params, shard, optimizer)``, run on every rank once a step:

    backward   the backward pass, one layer at a time: `for layer, g in backward:` gives each
               layer's gradient, LAST layer first, the moment backward has computed it; every g is
               a fresh buffer (the layer's whole gradient of this rank's samples), and it stays in
               memory as long as you keep a reference to it
    params     params[layer]: that layer's whole flat weights (every rank holds all of them)
    shard      shard[layer]: room for this rank's chunk of that layer's summed gradient (zeroed;
               fill it in place)
    optimizer  optimizer.step(layer, w[a:b], shard[layer]) updates this rank's chunk in place

ZeRO-2: as backward yields each layer, reduce-scatter its gradient (then chunk r of g on rank r
is the sum over all ranks), keep your chunk, and drop the buffer; after backward, step your
chunk of every layer and all-gather the layer's weights. Each rank's loss is already scaled by
1/global batch: the ranks' gradients SUM to the one-device gradient.

The check measures three things on 1..4 ranks: every rank's weights against one device, the
bytes each rank sends (a reduce-scatter and an all-gather of every layer), and the peak memory
the step allocates (a few layers in flight: the check allows half the gradient, never the whole).

The body below is plain data parallelism. Turn it into ZeRO-2:

    dplab lesson check 10 DIR
"""

from __future__ import annotations

from dplab.reference.collectives import allgather, allreduce, reduce_scatter  # noqa: F401 (yours to use)
from dplab.reference.schedule import chunk_bounds  # noqa: F401 (yours to use)


def zero2_step(comm, backward, params, shard, optimizer) -> None:
    grads = {}
    for layer, g in backward:
        allreduce(comm, g)  # every rank gets the whole summed gradient of the layer...
        grads[layer] = g  # ...and keeps it
    for layer, w in enumerate(params):
        optimizer.step(layer, w, grads[layer])  # ...and updates every parameter
