"""Synchronous data parallelism: every rank takes the same step, as if it were one device.

    from dplab.backends.launch.world import launch
    results = launch(train_sync, 4, args=(TrainConfig(), SyncConfig("ring")))
    # every results[r].params is the same bits, within rounding of train_single(TrainConfig()).params

``train_sync`` is the recipe in five numbered steps; ``SyncConfig`` says how the ranks reduce
(algorithm, buckets, micro-batches). Checkpoints, stragglers, a time budget, trace spans and mixed
precision attach to the recipe as hooks (``dplab.reference.train.hooks``, ``SyncConfig.hooks``); with
none, the recipe's lines are all that runs.

    SyncConfig("tree", bucket_cap_mb=1, accum_steps=4)    # validated by train_sync, per world size

Where it computes: on a communicator whose buffers live on a CUDA device (the cuda backend, the torch
backend with NCCL), on that GPU with torch tensors (``compute_device``); everywhere else in NumPy on the
host. The same lines run either way (``dplab.reference.model.array_namespace``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing, nullcontext
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
from dplab.reference.model import array_namespace
from dplab.reference.optim import make_optimizer
from dplab.reference.precision.amp import Amp
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.checkpoints import Checkpoints
from dplab.reference.train.hooks import Hook, Hooks, Run
from dplab.reference.train.single import TrainConfig, TrainResult, check_finite, on_host, setup
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

__all__ = ["SyncConfig", "train_sync", "compute_device"]


def train_sync(comm: Communicator, cfg: TrainConfig, sync: SyncConfig | None = None,
               hooks: Sequence[Hook] = (), device: Any = None) -> TrainResult:
    """Run on every rank; returns this rank's final parameters and the global batch's loss per step.

    The replicas end bitwise identical; against ``train_single`` they agree to rounding (float64:
    1e-10 relative), as the all-reduce adds the shards' gradients in another order. ``sync`` defaults
    to ``SyncConfig()``; ``hooks`` run after those it asks for (``SyncConfig.hooks``). ``device``: a
    torch device to compute on (the tests' CPU); None: ``compute_device`` picks."""
    sync = sync or SyncConfig()
    sync.validate(comm.world_size, comm.hosts)  # e.g. hierarchical:g against the hosts: one line
    device = compute_device(comm, sync, device)  # the comm's GPU: torch computes there; None: NumPy, host
    hook = sync.hooks(comm, cfg, hooks)  # all attached hooks as one; None: no hook at all
    model, data, params = setup(cfg, device, comm.rank)  # not rank 0's weights: the broadcast must fix them
    broadcast(comm, params, root=0)  # 1. every replica starts from rank 0's parameters
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices, device)
    run = Run(params, opt, params.dtype)  # what the hooks see, and may change before the first step
    if hook:
        hook.on_start(run)  # e.g. resume from a checkpoint
    grad = (comm.empty(model.num_params, run.grad_dtype) if device is None  # buckets are slices of it:
            else array_namespace(params).empty_like(params))  # no packing (on a GPU: next to the weights)
    scale = 1 / cfg.global_batch  # the global batch, not the shard: shard gradients sum to its mean
    with closing(Reducer(comm, grad, model.param_slices, sync.bucket_cap_mb, sync.algorithm)) as reducer:
        for step in range(run.start, cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)  # 2. this rank's shard of the batch
            grad[:], loss = 0, 0.0
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
                reducer.wait()  # 4. ... until the last bucket is summed; then it is ready for the next step
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
    return TrainResult(on_host(params), run.losses)  # NumPy on every backend: callers compare and pickle it


@dataclass(frozen=True)
class SyncConfig:
    """How the ranks reduce (algorithm, buckets, micro-batches) and what the run adds around it."""

    algorithm: str = "ring"  # any name of the registry (reference/algorithms), "native" or "auto"
    bucket_cap_mb: float = 25.0  # as in torch DDP
    accum_steps: int = 1  # micro-batches per step; all but the last run under no_sync
    straggler: Stragglers = ()  # ((rank, factor), ...): those ranks compute factor times slower
    time_budget_s: float | None = None  # stop after the step during which this much time ran out
    delays: tuple[float, ...] | None = None  # seconds rank r sleeps before each micro-batch: delays[r]
    checkpoint: CheckpointConfig | None = None  # rank 0 saves; every rank resumes (checkpoint/)
    precision: MixedPrecision | None = None  # float16 compute and loss scaling (precision/)

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def validate(self, world_size: int | None = None, hosts: Sequence[int] | None = None) -> None:
        """Refuse what cannot run on ``world_size`` ranks placed on ``hosts`` (``comm.hosts``; e.g. a
        ``hierarchical:g`` whose g is not the ranks per host: ``layout.resolve``)."""
        if not has_schedule(self.algorithm):
            raise ConfigError(f"unknown algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
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

    def hooks(self, comm: Communicator, cfg: TrainConfig, more: Sequence[Hook] = ()) -> Hooks | None:
        """Rank ``comm.rank``'s hooks for this run, in the order they run, then ``more``; None: no hook."""
        amp = Amp(comm, self) if self.precision is not None else None  # first: it swaps the optimizer
        factor = dict(self.straggler).get(comm.rank, 1.0)
        delay_s = self.delays[comm.rank] if self.delays else 0.0
        hooks = [
            amp,
            Checkpoints(comm, cfg, self, self.checkpoint, amp) if self.checkpoint is not None else None,
            Spans(comm.tracer) if comm.tracer.enabled else None,  # outside the straggler's sleeps
            Straggle(Slowdown(factor, comm.tracer), delay_s) if factor > 1 or delay_s > 0 else None,
            TimeBudget(self.time_budget_s) if self.time_budget_s is not None and comm.rank == 0 else None,
            *more,
        ]
        attached = [hook for hook in hooks if hook is not None]
        return Hooks(attached) if attached else None


def compute_device(comm: Communicator, sync: SyncConfig, device: Any = None) -> Any:
    """Where ``train_sync`` computes: ``device`` if given, else the communicator's device if it is a
    CUDA GPU (the cuda backend, the torch backend with NCCL), with torch tensors there; None: in NumPy
    on the host (every other backend). Checkpoints and mixed precision stay NumPy's: refused on a device."""
    if device is None and getattr(getattr(comm, "device", None), "type", None) == "cuda":
        device = comm.device
    if device is not None and (sync.checkpoint is not None or sync.precision is not None):
        raise ConfigError(f"on {device} the recipe computes with torch tensors, but checkpoints and mixed "
                          "precision work on NumPy arrays on the host: drop them, or use --backend local")
    return device
