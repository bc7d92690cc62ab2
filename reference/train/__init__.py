"""The trainers: one device (the oracle), synchronous data parallelism, and what they share.

reference/README.md maps the files. What "equal" means, as the tests check it: replicas of a
synchronous run are BITWISE identical, and so is a resumed run to an uninterrupted one; against
one device (``train_single``) a data-parallel run agrees to ROUNDING (relative 1e-10 in float64,
1e-5 in float32), because the all-reduce adds the shards' gradients in another order.

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
                  sending to every other directly: ``direct`` (the ring's bytes in 2 rounds
                  instead of 2(p - 1)); the local backend's ``native`` is one-shot: one round,
                  each rank reducing its chunk in every rank's shared buffer
"""
