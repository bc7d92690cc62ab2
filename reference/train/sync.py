"""Synchronous data parallelism: every rank takes the same step, as if it were one device.

    from dplab.backends.launch.world import launch
    from dplab.reference.train.sync import SyncConfig, train_sync
    from dplab.reference.train.single import TrainConfig, train_single
    results = launch(train_sync, 4, args=(TrainConfig(), SyncConfig("ring")))
    # every rank's results[r].params are bitwise identical, and within rounding of
    # train_single(TrainConfig()).params (float64: 1e-10 relative; measured: ~1e-16)

The recipe, one step at a time (``train_sync`` below is these five, in order):

1. At start-up rank 0's parameters are broadcast, so every replica starts equal.
2. The global batch of step t is cut into contiguous shards, one per rank (the first
   B mod p ranks get one sample more). Each rank's loss is scaled by 1/B, the
   *global* batch size, so the shard gradients simply sum to the full-batch
   gradient: uneven shards are weighted by their size for free.
3. Forward and backward on this rank's shard, cut again into ``accum_steps``
   micro-batches. Gradients accumulate over them; only the last micro-batch's
   backward pass launches the all-reduce (the others run under ``no_sync``).
4. During that backward pass, buckets of gradients are all-reduced by a
   communication thread as soon as they are complete (``dplab.reference.train.buckets``);
   ``wait()`` for the last bucket.
5. Every rank applies the same optimizer step to the same summed gradient, so the
   replicas stay BITWISE identical to each other. Against one device they agree to
   rounding, not to the bit: the all-reduce adds the shards' gradients in another order
   than one device's backward adds its samples', and float addition is not associative.

Mixed precision (``SyncConfig.precision``) is four calls of ``Amp``
(``dplab.reference.precision.amp``), as torch AMP's ``scaler.scale(loss)`` and ``scaler.step(opt)``:
float16 weights for forward and backward, the loss scaled, the reduced gradient unscaled into
float32 for the optimizer (or the step skipped on an overflow). Without it each is a no-op.

Everything else a real run does (resume and checkpoints, stragglers, the time-budget
vote, trace spans) is one call of ``SyncExtras`` (``dplab.reference.train.sync_extras``)
at the place it happens, so the recipe reads on its own. Stragglers change when things
happen, not what is computed: the whole world runs at the slowest rank's pace, which is
the price of synchronous training, and the parameters are the same bits as without one.
"""

from __future__ import annotations

from contextlib import closing, nullcontext

from dplab.reference.collectives import broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.optim import make_optimizer
from dplab.reference.precision.amp import Amp
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.single import TrainConfig, TrainResult, setup
from dplab.reference.train.sync_config import SyncConfig
from dplab.reference.train.sync_extras import SyncExtras

__all__ = ["SyncConfig", "train_sync"]  # SyncConfig lives in sync_config.py

_DEFAULT = SyncConfig()  # ring all-reduce, 25 MB buckets, one micro-batch, no extras


def train_sync(comm: Communicator, cfg: TrainConfig, sync: SyncConfig = _DEFAULT) -> TrainResult:
    """Run on every rank; returns this rank's final parameters and the global loss per step."""
    sync.validate(comm.world_size)
    extras = SyncExtras(comm, cfg, sync)  # checkpoints, stragglers, time budget, trace spans
    model, data, params = setup(cfg)
    if comm.rank != 0:  # anything but rank 0's weights: the broadcast must fix it
        params = model.init_params(cfg.seed + 1 + comm.rank, dtype=params.dtype)
    broadcast(comm, params, root=0)  # 1. every replica starts from rank 0's parameters
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices)
    amp = Amp(comm, sync, params)  # mixed precision (float16 compute, loss scaling); off: a no-op
    grad = comm.empty(model.num_params, amp.reduce_dtype)  # buckets are slices of it: no packing
    scale = 1 / cfg.global_batch  # the global batch, not the shard: shard gradients sum to its mean
    with closing(Reducer(comm, grad, model.param_slices, sync.bucket_cap_mb, sync.algorithm)) as reducer:
        for step in range(extras.resume(params, opt, amp), cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)  # 2. this rank's shard of the batch
            grad[:], loss = 0, 0.0
            reducer.reset()
            weights, scaled = amp.weights(params), amp.scale(scale)  # mixed precision: float16, S / B
            for j, (a, b) in enumerate(chunk_bounds(len(mine), sync.accum_steps)):  # 3. micro-batches:
                x, y = data.x[mine[a:b]], data.y[mine[a:b]]
                with reducer.no_sync() if j < sync.accum_steps - 1 else nullcontext():  # the last reduces
                    with extras.forward(step, j):
                        acts = model.forward(weights, x)
                        loss += model.loss(acts, y, scale)
                    for layer in extras.backward(step, j, model.backward(weights, acts, y, grad, scaled)):
                        reducer.mark_param_as_ready(2 * layer + 1)  # 4. a bucket whose gradients are
                        reducer.mark_param_as_ready(2 * layer)  # all there is all-reduced at once
            with extras.span("wait", step):
                reducer.wait()  # 4. ... until the last bucket is summed
            with extras.span("optimizer", step):
                amp.step(opt, params, grad, step)  # 5. the same step on every rank (skipped on overflow)
            if extras.end_step(step, loss, params, opt, amp):  # the loss, the budget vote, a checkpoint
                break
    return TrainResult(params, extras.losses)
