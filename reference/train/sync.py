"""Synchronous data parallelism: every rank takes the same step, as if it were one device.

    from dplab.backends.launch.world import launch
    results = launch(train_sync, 4, args=(TrainConfig(), SyncConfig("ring")))
    # every results[r].params is the same bits, within rounding of train_single(TrainConfig()).params

``train_sync`` is the recipe in five numbered steps. Checkpoints, stragglers, a time budget, trace
spans and mixed precision attach to it as hooks (``dplab.reference.train.hooks``); with none, the
recipe's lines are all that runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing, nullcontext

import numpy as np

from dplab.reference.collectives import allreduce, broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.optim import make_optimizer
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.diverged import check_finite
from dplab.reference.train.hooks import Hook, Run
from dplab.reference.train.single import TrainConfig, TrainResult, setup
from dplab.reference.train.sync_config import SyncConfig

__all__ = ["SyncConfig", "train_sync"]  # SyncConfig lives in sync_config.py

_DEFAULT = SyncConfig()  # ring all-reduce, 25 MB buckets, one micro-batch, no hooks


def train_sync(comm: Communicator, cfg: TrainConfig, sync: SyncConfig = _DEFAULT,
               hooks: Sequence[Hook] = ()) -> TrainResult:
    """Run on every rank; returns this rank's final parameters and the global batch's loss per step.

    The replicas end bitwise identical; against ``train_single`` they agree to rounding (float64:
    1e-10 relative), as the all-reduce adds the shards' gradients in another order. ``hooks`` run
    after those ``sync`` asks for (``SyncConfig.hooks``)."""
    sync.validate(comm.world_size, comm.hosts)  # e.g. hierarchical:g against the hosts: one line
    hook = sync.hooks(comm, cfg, hooks)  # all attached hooks as one; None: no hook at all
    model, data, params = setup(cfg)
    if comm.rank != 0:  # anything but rank 0's weights: the broadcast must fix it
        params = model.init_params(cfg.seed + 1 + comm.rank, dtype=params.dtype)
    broadcast(comm, params, root=0)  # 1. every replica starts from rank 0's parameters
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices)
    run = Run(params, opt, params.dtype)  # what the hooks see, and may change before the first step
    if hook:
        hook.on_start(run)  # e.g. resume from a checkpoint
    grad = comm.empty(model.num_params, run.grad_dtype)  # buckets are slices of it: no packing
    scale = 1 / cfg.global_batch  # the global batch, not the shard: shard gradients sum to its mean
    with closing(Reducer(comm, grad, model.param_slices, sync.bucket_cap_mb, sync.algorithm)) as reducer:
        for step in range(run.start, cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)  # 2. this rank's shard of the batch
            grad[:], loss = 0, 0.0
            reducer.reset()
            weights, scaled = hook.compute(step, params, scale) if hook else (params, scale)
            for j, (a, b) in enumerate(chunk_bounds(len(mine), sync.accum_steps)):  # 3. micro-batches:
                x, y = data.x[mine[a:b]], data.y[mine[a:b]]
                with reducer.no_sync() if j < sync.accum_steps - 1 else nullcontext():  # the last reduces
                    with hook.forward(step, j) if hook else nullcontext():
                        acts = model.forward(weights, x)
                        loss += model.loss(acts, y, scale)
                    layers = model.backward(weights, acts, y, grad, scaled)
                    for layer in hook.backward(step, j, layers) if hook else layers:
                        for i in model.layer_params(layer):  # 4. a bucket whose gradients are all
                            reducer.mark_param_as_ready(i)  # there is all-reduced at once
            with hook.phase("wait", step) if hook else nullcontext():
                reducer.wait()  # 4. ... until the last bucket is summed
            with hook.phase("optimizer", step) if hook else nullcontext():
                run.opt.step(params, grad)  # 5. the same step on every rank: the replicas stay equal
            total = np.array([loss, hook.wants_to_stop(step) if hook else 0.0])  # a hook may ask to stop
            allreduce(comm, total, reducer.algorithm_for(total))  # the batch's loss; did any rank ask to stop
            run.losses.append(float(total[0]))
            if hook:
                hook.after_step(run, step)  # e.g. save a checkpoint
            if total[1] > 0:  # the same answer on every rank: all stop after the same step
                break
    check_finite(params, run.losses)  # a run that diverged ends in one line of error, not in nan
    return TrainResult(params, run.losses)
