"""Synchronous data parallelism: every rank takes the same step, as if it were one device.

    from dplab.backends.launch.world import launch
    from dplab.reference.train.sync import SyncConfig, train_sync
    from dplab.reference.train.single import TrainConfig, train_single
    results = launch(train_sync, 4, args=(TrainConfig(), SyncConfig("ring")))
    # results[r].params equals train_single(TrainConfig()).params on every rank r

The recipe, one step at a time:

1. At start-up rank 0's parameters are broadcast, so every replica starts equal.
2. The global batch of step t is cut into contiguous shards, one per rank (the first
   B mod p ranks get one sample more). Each rank's loss is scaled by 1/B, the
   *global* batch size, so the shard gradients simply sum to the full-batch
   gradient: uneven shards are weighted by their size for free.
3. A rank's shard is cut again into ``accum_steps`` micro-batches. Gradients
   accumulate over them; only the last micro-batch's backward pass launches the
   all-reduce (the others run under ``no_sync``).
4. During that backward pass, buckets of gradients are all-reduced by a
   communication thread as soon as they are complete (``dplab.reference.train.buckets``).
5. ``wait()`` for the last bucket, then every rank applies the same optimizer step
   to the same summed gradient, so the replicas stay bitwise identical.

Stragglers and budgets (``dplab.reference.train.straggler``): a straggler rank's forward and
backward pieces are stretched by its factor (``delays`` adds a fixed sleep before each
micro-batch instead, for deterministic tests), and since every step needs every rank's
gradient, the whole world runs at the straggler's pace: that is the price of
synchronous training, and the parameters are still exactly single-device ones. Under
a ``time_budget_s`` rank 0 votes to stop once the budget is spent; its vote rides on
the loss all-reduce each step already does (a second number, 1 from rank 0 when time
is up, 0 from everyone else), so all ranks stop after the same step at no extra cost.
At least one step is always taken; ``TrainConfig.steps`` remains the upper bound.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
from dplab.reference.algorithms import ALGORITHMS
from dplab.reference.checkpoint.resume import CheckpointConfig, load_resume, run_meta, save_state
from dplab.reference.collectives import allreduce, broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import ConfigError
from dplab.reference.optim import Optimizer, make_optimizer
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.single import TrainConfig, TrainResult, setup
from dplab.reference.train.straggler import (
    Budget,
    Slowdown,
    Stragglers,
    check_budget,
    check_delays,
    check_stragglers,
)

__all__ = ["SyncConfig", "train_sync"]


@dataclass(frozen=True)
class SyncConfig:
    algorithm: str = "ring"  # naive | ring | tree | direct | native
    bucket_cap_mb: float = 25.0  # as in torch DDP
    accum_steps: int = 1  # micro-batches per step; all but the last run under no_sync
    straggler: Stragglers = ()  # ((rank, factor), ...): those ranks compute factor times slower
    time_budget_s: float | None = None  # stop after the step during which this much time ran out
    delays: tuple[float, ...] | None = None  # seconds rank r sleeps before each micro-batch: delays[r]
    checkpoint: CheckpointConfig | None = None  # rank 0 saves; every rank resumes (checkpoint/)

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def validate(self, world_size: int | None = None) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.accum_steps < 1:
            raise ConfigError(f"accum_steps must be >= 1, got {self.accum_steps}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        check_stragglers(self.straggler, world_size)
        check_delays(self.delays, world_size, "rank")
        check_budget(self.time_budget_s)
        if self.checkpoint is not None:
            self.checkpoint.validate()


def train_sync(comm: Communicator, cfg: TrainConfig, sync: SyncConfig = SyncConfig()) -> TrainResult:
    """Run on every rank; returns this rank's final parameters and the global loss per step."""
    sync.validate(comm.world_size)
    budget = Budget(sync.time_budget_s)  # rank 0's clock starts now: set-up counts too
    model, data, params = setup(cfg)
    if comm.rank != 0:  # anything but rank 0's weights: the broadcast must fix it
        params = model.init_params(cfg.seed + 1 + comm.rank, dtype=params.dtype)
    broadcast(comm, params, root=0)
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype)
    meta = run_meta("sync", cfg, sync, comm.world_size)
    losses, start = resume(sync.checkpoint, meta, params, opt)
    grad = comm.empty(model.num_params, params.dtype)  # buckets are slices of it: no packing
    reducer = Reducer(comm, grad, model.param_slices, sync.bucket_cap_mb, sync.algorithm)
    loss_buf = np.zeros(2, dtype=np.float64)  # [this step's loss, rank 0's vote to stop]
    tracer = comm.tracer
    slow = Slowdown.for_rank(sync.straggler, comm.rank, tracer)
    delay = sync.delays[comm.rank] if sync.delays else 0.0
    try:
        for step in range(start, cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)
            grad[:] = 0
            reducer.reset()
            loss_buf[0] = 0.0
            micro = chunk_bounds(len(mine), sync.accum_steps)
            for j, (a, b) in enumerate(micro):
                last = j == len(micro) - 1
                x, y = data.x[mine[a:b]], data.y[mine[a:b]]
                with nullcontext() if last else reducer.no_sync():
                    with tracer.span("forward", extra={"step": step, "micro": j}), slow.compute(delay):
                        acts = model.forward(params, x)
                        loss_buf[0] += model.loss(acts, y, 1 / cfg.global_batch)
                    with tracer.span("backward", extra={"step": step, "micro": j}):
                        layers = model.backward(params, acts, y, grad, 1 / cfg.global_batch)
                        for layer in slow.pieces(layers):
                            reducer.mark_param_as_ready(2 * layer + 1)
                            reducer.mark_param_as_ready(2 * layer)
            with tracer.span("wait", extra={"step": step}):
                reducer.wait()
            with tracer.span("optimizer", extra={"step": step}):
                opt.step(params, grad)
            loss_buf[1] = 1.0 if comm.rank == 0 and budget.spent() else 0.0
            allreduce(comm, loss_buf, sync.algorithm)  # the global batch's loss, and the vote
            losses.append(float(loss_buf[0]))
            if comm.rank == 0 and sync.checkpoint is not None and sync.checkpoint.due(step + 1):
                save_state(sync.checkpoint, step + 1, params, opt.state_dict(),
                           {"step": step + 1, "losses": losses}, meta)
            if loss_buf[1] > 0:
                break
    finally:
        reducer.close()
    return TrainResult(params, losses)


def resume(ckpt: CheckpointConfig | None, meta: dict, params: np.ndarray,
           opt: Optimizer) -> tuple[list[float], int]:
    """Load the checkpoint into ``params`` and ``opt`` (every rank reads the same file, so the
    replicas start equal); returns the losses so far and the first step to take."""
    state = load_resume(ckpt, meta)
    if state is None:
        return [], 0
    params[:] = state.params
    opt.load_state_dict(state.optimizer_state)
    return [float(v) for v in state.data_position["losses"]], int(state.data_position["step"])
