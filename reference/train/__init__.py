"""The trainers: one device (the oracle), synchronous data parallelism, and what they share.

    single.py       TrainConfig, train_single: the single-device run every other run is checked against;
                    check_finite: a run whose weights or last loss are inf or nan ends in one line of error
    sync.py         train_sync: the data-parallel recipe (broadcast, shard, backward, all-reduce, step);
                    SyncConfig: the all-reduce algorithm, bucket size, micro-batches, and the hooks
    buckets.py      Reducer: gradients in buckets, each all-reduced as soon as it is complete
    hooks.py        Hook: what a real run attaches to the recipe, at the points its methods name
    checkpoints.py  the checkpoint hook: resume at the start, save every k steps
    spans.py        the trace hook: forward, backward, wait and optimizer spans
    straggler.py    slow a rank down on purpose; the wall-time budget both trainers can stop on

What "equal" means here, as the tests check it: the replicas of a synchronous run are
BITWISE identical to each other, and a resumed run is bitwise identical to an
uninterrupted one; against one device (``train_single``) a data-parallel run agrees to
ROUNDING: relative 1e-10 in float64, 1e-5 in float32 (measured ~1e-16 in float64),
because the all-reduce adds the shards' gradients in another order than one device does.

Glossary (the words as dplab uses them; the parameter server's are in ``dplab.reference.ps``):

    shard         this rank's contiguous part of the global batch (uneven splits allowed)
    micro-batch   a piece of a shard; gradients accumulate over ``accum_steps`` of them
    bucket        a contiguous slice of the flat gradient, all-reduced once complete
    SSP           stale synchronous parallel: the parameter server's rule, a worker may run at
                  most s clocks ahead of the slowest (the asynchronous alternative to this sync)
    clock         a parameter-server worker's step: one pull, compute, push
    staleness     in CLOCKS: how far an SSP worker may run ahead of the slowest
    delay         in UPDATES: how many updates landed between a gradient's pull and its own
                  update (``LogEntry.delay``); synchronous training's delay is always 0
    two-shot      an all-reduce in two rounds, reduce-scatter then all-gather, each rank
                  sending to every other directly: ``direct``, the local backend's ``native``
                  (same bytes as the ring, 2 rounds instead of 2(p - 1))
"""
