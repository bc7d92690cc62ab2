"""Synchronous data parallelism: every rank takes the same step, as if it were one device.

    from dplab.backends.launch.world import launch
    results = launch(train_sync, 4, args=(TrainConfig(), SyncConfig("ring")))
    # every results[r].params: the same bits, within rounding of train_single(TrainConfig()).params

``train_sync`` is the recipe in five numbered steps, read top to bottom; ``naive.py`` beside it is
the same idea with no buckets, and the place to start. ``SyncConfig`` says how the ranks reduce
(algorithm, buckets, micro-batches). Checkpoints, stragglers, a time budget, trace spans and mixed
precision attach to the recipe as hooks (``dplab.reference.train.hooks``, ``SyncConfig.hooks``):
the recipe calls every hook point on every step, and with none attached each call does nothing.

    SyncConfig("tree", bucket_cap_mb=1, accum_steps=4)    # validated by train_sync, per world size

Where it computes is not the recipe's choice: its caller passes a torch ``device``, or the launcher
put the rank on a GPU (``comm.compute_device``: the cuda backend, the torch backend with NCCL);
otherwise NumPy on the host. The same lines run either way (``model.array_namespace``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.algorithms.layout import resolve
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.collectives import allreduce, broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import ConfigError
from dplab.reference.optim import make_optimizer
from dplab.reference.precision.amp import Amp
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.checkpoints import Checkpoints
from dplab.reference.train.hooks import Hook, Hooks, Run
from dplab.reference.train.single import (
    TrainConfig,
    TrainResult,
    check_finite,
    on_device,
    on_host,
    setup,
)
from dplab.reference.train.spans import Spans
from dplab.reference.train.straggler import (
    Slowdown,
    Straggle,
    Stragglers,
    TimeBudget,
    check_budget,
    check_delays,
    check_stragglers,
)

__all__ = ["SyncConfig", "train_sync", "loss_and_stop", "compute_device"]


def train_sync(comm: Communicator, cfg: TrainConfig, sync: SyncConfig | None = None,
               hooks: Sequence[Hook] = (), device: Any = None) -> TrainResult:
    """Train ``cfg`` on this rank as one replica of a synchronous data-parallel run.

    Every rank of the world calls it with the same arguments. The replicas end bitwise identical;
    against ``train_single`` they agree to rounding (float64: 1e-10 relative), as the all-reduce
    adds the shards' gradients in another order.

    Args:
        comm: this rank's communicator.
        cfg: the model, data, optimizer and number of steps.
        sync: how the ranks reduce, and the hooks it asks for; None: ``SyncConfig()``.
        hooks: more hooks, run after ``sync``'s (``dplab.reference.train.hooks``).
        device: the torch device to compute on, the caller's choice; None: where the launcher
            put this rank (``comm.compute_device``: a GPU, or NumPy on the host).

    Returns:
        This rank's final parameters (a NumPy array) and the global batch's loss per step.

    Raises:
        ConfigError: ``sync`` cannot run on this world or device, or the run diverged.
    """
    sync = sync or SyncConfig()
    device = device or comm.compute_device  # the caller's choice, else where the launcher put us
    sync.validate(comm.world_size, comm.hosts, device)  # e.g. hierarchical:g against the hosts
    hooks = sync.hooks(comm, cfg, hooks)  # all as one; none attached: each call below does nothing
    model, data, params = setup(cfg, device, comm.rank)  # each rank draws its own weights, so:
    broadcast(comm, params, root=0)  # 1. every replica starts from rank 0's parameters
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices, device)
    run = Run(params, opt, np.dtype(cfg.dtype))  # what the hooks see, and may change, before step 0
    hooks.on_start(run)  # e.g. resume from a checkpoint
    grad = on_device(device, comm.empty(model.num_params, run.grad_dtype))  # the flat gradient
    scale = 1 / cfg.global_batch  # the global batch, not the shard: shard gradients sum to its mean
    reducer = Reducer(comm, grad, model.param_slices, sync.bucket_cap_mb, sync.algorithm)
    with closing(reducer):  # its comm thread ends with the run
        for step in range(run.start, cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)  # 2. this rank's shard of the batch
            grad[:], loss = 0, 0.0
            weights, scaled = hooks.compute(step, params, scale)  # mixed precision: float16, x S
            for j, (a, b) in enumerate(chunk_bounds(len(mine), sync.accum_steps)):
                x, y = data.x[mine[a:b]], data.y[mine[a:b]]  # 3. forward, backward: micro-batch j
                reducer.require_backward_grad_sync = j == sync.accum_steps - 1  # the last reduces
                with hooks.forward(step, j):
                    acts = model.forward(weights, x)
                    loss += model.loss(acts, y, scale)
                layers = model.backward(weights, acts, y, grad, scaled)  # yields each one done
                for layer in hooks.backward(step, j, layers):
                    for i in model.layer_params(layer):  # 4. a bucket whose gradients are all there
                        reducer.mark_param_as_ready(i)  # is all-reduced by the comm thread
            with hooks.phase("wait", step):
                reducer.wait()  # ... while backward goes on; here until the last one is summed
            with hooks.phase("optimizer", step):
                run.opt.step(params, grad)  # 5. the same step on every rank: replicas stay equal
            batch_loss, stop = loss_and_stop(comm, reducer, loss, hooks.wants_to_stop(step))
            run.losses.append(batch_loss)
            hooks.after_step(run, step)  # e.g. save a checkpoint
            if stop:  # some rank asked (its time budget ran out): every rank stops after this step
                break
    check_finite(params, run.losses)  # a run that diverged ends in one line of error, not in nan
    return TrainResult(on_host(params), run.losses)  # NumPy on every backend: callers compare it


def loss_and_stop(comm: Communicator, reducer: Reducer, loss: float,
                  stop: bool) -> tuple[float, bool]:
    """The global batch's loss, and whether any rank asks to stop: one all-reduce of two numbers.

    The shards' losses sum to the batch's; the stop requests (1 or 0) sum to how many ranks asked,
    the same count on every rank, so every rank stops after the same step (a time budget is rank
    0's alone). Asking rides on the loss's all-reduce because a second one would cost every step
    one more latency for one bit.

    Args:
        comm: this rank's communicator.
        reducer: the step's reducer: its algorithm, resolved for two numbers.
        loss: this rank's share of the batch's loss (its shard's losses times ``1 / global_batch``).
        stop: does this rank ask every rank to stop after this step?

    Returns:
        The batch's loss, and True if any rank asked to stop.
    """
    both = np.array([loss, stop])
    allreduce(comm, both, reducer.algorithm_for(both))
    return float(both[0]), bool(both[1] > 0)


@dataclass(frozen=True)
class SyncConfig:
    """How the ranks reduce (algorithm, buckets, micro-batches) and what the run adds around it.

    Args:
        algorithm: the buckets' all-reduce: a registered name, "native" or "auto".
        bucket_cap_mb: gradient bucket size in MiB.
        accum_steps: micro-batches per step.
        straggler: ((rank, factor), ...): ranks that compute factor times slower.
        time_budget_s: stop after the step during which this much time ran out, or None.
        delays: seconds each rank sleeps before each micro-batch, or None.
        checkpoint: where and how often to save, and what to resume from, or None.
        precision: mixed precision, or None.
    """

    algorithm: str = "ring"  # any name of the registry (reference/algorithms), "native" or "auto"
    bucket_cap_mb: float = 25.0  # as in torch DDP
    accum_steps: int = 1  # micro-batches per step; all but the last run under no_sync
    straggler: Stragglers = ()  # ((rank, factor), ...): those ranks compute factor times slower
    time_budget_s: float | None = None  # stop after the step during which this much time ran out
    delays: tuple[float, ...] | None = None  # rank r sleeps delays[r] s before each micro-batch
    checkpoint: CheckpointConfig | None = None  # rank 0 saves; every rank resumes (checkpoint/)
    precision: MixedPrecision | None = None  # float16 compute and loss scaling (precision/)

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def validate(self, world_size: int | None = None, hosts: Sequence[int] | None = None,
                 device: Any = None) -> None:
        """Refuse what cannot run on ``world_size`` ranks on ``hosts``, computing on ``device``.

        Args:
            world_size: the ranks (stragglers and delays name them); None: not checked.
            hosts: each rank's host (``comm.hosts``): a ``hierarchical:g`` whose g is not the
                ranks per host is refused (``layout.resolve``); None: not checked.
            device: where the recipe computes; a torch device refuses checkpoints and mixed
                precision, which work on NumPy arrays on the host.

        Raises:
            ConfigError: naming the field to change.
        """
        if not has_schedule(self.algorithm):
            raise ConfigError(f"unknown algorithm {self.algorithm!r}: choose one of "
                              f"{', '.join(ALGORITHMS)}")
        if hosts is not None:
            resolve(self.algorithm, hosts)
        if self.accum_steps < 1:
            raise ConfigError(f"accum_steps must be >= 1, got {self.accum_steps}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.straggler:
            check_stragglers(self.straggler, world_size)
        if self.delays is not None:
            check_delays(self.delays, world_size, "rank")
        if self.time_budget_s is not None:
            check_budget(self.time_budget_s)
        if self.checkpoint is not None:
            self.checkpoint.validate()
        if self.precision is not None:
            self.precision.validate()
        if device is not None and (self.checkpoint is not None or self.precision is not None):
            raise ConfigError(f"on {device} the recipe computes with torch tensors, but "
                              "checkpoints and mixed precision work on NumPy arrays on the host: "
                              "drop them, or use --backend local")

    def hooks(self, comm: Communicator, cfg: TrainConfig, more: Sequence[Hook] = ()) -> Hooks:
        """Rank ``comm.rank``'s hooks for this run as one, in the order they run.

        Args:
            comm: this rank's communicator (its rank picks its straggler and delay; rank 0 keeps
                the time budget; a tracer that is on adds trace spans).
            cfg: the run's configuration (a checkpoint records it).
            more: the caller's hooks, run after these.

        Returns:
            ``Hooks`` of those attached; with none, every one of its points does nothing.
        """
        amp = Amp(comm, self) if self.precision is not None else None  # first: swaps the optimizer
        factor = dict(self.straggler).get(comm.rank, 1.0)
        delay_s = self.delays[comm.rank] if self.delays else 0.0
        budget_s = self.time_budget_s if comm.rank == 0 else None  # rank 0 decides for everyone
        hooks = [
            amp,
            Checkpoints(comm, cfg, self, self.checkpoint, amp) if self.checkpoint else None,
            Spans(comm.tracer) if comm.tracer.enabled else None,  # outside the straggler's sleeps
            Straggle(Slowdown(factor, comm.tracer), delay_s) if factor > 1 or delay_s > 0 else None,
            TimeBudget(budget_s) if budget_s is not None else None,
            *more,
        ]
        return Hooks(hook for hook in hooks if hook is not None)


def compute_device(comm: Any, sync: SyncConfig, device: Any = None) -> Any:
    """Where ``train_sync(comm, cfg, sync, device=device)`` computes, for a caller that asks.

    Args:
        comm: the rank's communicator (any object with the ``device`` its launcher gave it).
        sync: the run's reduction, checked against that device.
        device: the caller's torch device, if it chooses one.

    Returns:
        ``device`` if given, else ``Communicator.compute_device``: the communicator's device if
        it is a CUDA GPU (torch tensors there); None: NumPy arrays on the host.

    Raises:
        ConfigError: ``sync`` asks for checkpoints or mixed precision, which stay on the host.
    """
    device = device or Communicator.compute_device.fget(comm)  # the contract's rule, on any comm
    sync.validate(device=device)
    return device
