"""Synchronous data parallelism at its plainest: backward, all-reduce the gradient, step.

    from dplab.backends.launch.world import launch
    results = launch(train_naive, 4, args=(TrainConfig(),))
    # every results[r].params: the same bits, within rounding of train_single(TrainConfig()).params

Every rank holds a replica of the model and takes its shard of each global batch. After the
backward pass the whole flat gradient is summed over the ranks by one all-reduce, so every rank
steps with the gradient of the whole batch and the replicas stay equal. Nothing overlaps: the
network idles while backward runs, and backward waits for the network. ``sync.py`` is the same
recipe with the gradient all-reduced bucket by bucket while backward still runs (torch DDP's
reducer), micro-batches, and hooks for checkpoints, stragglers, time budgets and mixed precision;
with one bucket it steps to the same bits as this loop.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allreduce, broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.optim import make_optimizer
from dplab.reference.train.single import TrainConfig, TrainResult, setup

__all__ = ["train_naive"]


def train_naive(comm: Communicator, cfg: TrainConfig, algorithm: str = "ring") -> TrainResult:
    """Train ``cfg`` on this rank as one replica of a synchronous data-parallel run.

    Every rank of the world calls it with the same arguments. The replicas end bitwise identical;
    against ``train_single`` they agree to rounding (float64: 1e-10 relative), as the all-reduce
    adds the shards' gradients in another order.

    Args:
        comm: this rank's communicator.
        cfg: the model, data, optimizer and number of steps.
        algorithm: the all-reduce's schedule (``dplab.reference.algorithms``) or ``"native"``.

    Returns:
        This rank's final parameters and the global batch's loss per step.

    Raises:
        ConfigError: ``cfg`` or ``algorithm`` is not one dplab knows.
    """
    model, data, params = setup(cfg, rank=comm.rank)  # each rank draws its own weights, so:
    broadcast(comm, params, root=0)  # 1. every replica starts from rank 0's parameters
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices)
    grad, losses = np.zeros_like(params), []
    scale = 1 / cfg.global_batch  # the global batch, not the shard: shard gradients sum to its mean
    for step in range(cfg.steps):
        batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        mine = shard(batch, comm.rank, comm.world_size)  # 2. this rank's shard of the batch
        grad[:] = 0
        x, y = data.x[mine], data.y[mine]
        loss, _ = model.loss_and_grad(params, x, y, scale, grad)  # 3. forward and backward
        allreduce(comm, grad, algorithm)  # 4. the sum over the ranks: the whole batch's gradient
        opt.step(params, grad)  # 5. the same step on every rank: the replicas stay equal
        total = np.array([loss])
        allreduce(comm, total, algorithm)  # the shards' losses sum to the batch's too
        losses.append(float(total[0]))
    return TrainResult(params, losses)
