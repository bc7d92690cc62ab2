"""What a real run adds around the synchronous recipe, kept out of the recipe's way.

``dplab.reference.train.sync`` is the five steps of data parallelism; this file is everything
else one step of ``train_sync`` does, each as one small method it calls at one place:

    resume(params, opt, amp)    load a checkpoint into the replicas (and the loss scale), say
                                where to start
    forward(step, j)            a trace span around micro-batch j's forward pass, stretched
    backward(step, j, layers)   by a straggler's factor (``dplab.reference.train.straggler``)
    span(name, step)            a trace span ("wait", "optimizer")
    end_step(step, loss, ...)   all-reduce the loss with rank 0's vote to stop (the time
                                budget), record it, stop a diverged run, checkpoint when due;
                                True: stop now

The budget vote rides on the loss all-reduce each step already does (a second number,
1 from rank 0 when time is up, 0 from everyone else), so all ranks stop after the same
step at no extra cost. At least one step is always taken; ``TrainConfig.steps`` stays the
upper bound. Only rank 0 writes checkpoints (the replicas are bitwise identical); every
rank reads the same one on resume, so they start equal again.

A run whose weights turn inf or nan after a step, or whose last loss is not finite, raises
``ConfigError`` on every rank at that step (the replicas agree, and so does the all-reduced
loss), before a checkpoint could keep it: every later step would only carry the nan along, and
the run would end looking like any other. A non-finite loss on a step that dynamic loss scaling
skipped is not one: the weights did not move (torch's GradScaler carries on, and so does this).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np

from dplab.reference.checkpoint.resume import Expect, load_resume, save_state
from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.optim import Optimizer
from dplab.reference.precision.amp import Amp
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.straggler import Budget, Slowdown
from dplab.reference.train.sync_config import SyncConfig

__all__ = ["SyncExtras"]


class SyncExtras:
    """One rank's checkpoints, straggler slowdown, time budget and trace spans for ``train_sync``."""

    def __init__(self, comm: Communicator, cfg: TrainConfig, sync: SyncConfig) -> None:
        self.comm, self.sync, self.tracer = comm, sync, comm.tracer
        self.budget = Budget(sync.time_budget_s)  # rank 0's clock starts now: set-up counts too
        self.expect = Expect.of("sync", cfg, sync, comm.world_size, comm.backend)
        self.slow = Slowdown.for_rank(sync.straggler, comm.rank, self.tracer)
        self.delay_s = sync.delays[comm.rank] if sync.delays else 0.0  # a fixed sleep per micro-batch
        self.losses: list[float] = []  # the global batch's loss, per step
        self.last_step = cfg.steps - 1
        self.vote = np.zeros(2, dtype=np.float64)  # [this step's loss, rank 0's vote to stop]

    def resume(self, params: np.ndarray, opt: Optimizer, amp: Amp) -> int:
        """Load the checkpoint (if resuming) into ``params``, ``opt`` and the loss scaler of
        ``amp``; the first step to take."""
        state = load_resume(self.sync.checkpoint, self.expect)
        if state is None:
            return 0
        params[:] = state.params
        opt.load_state_dict(state.optimizer_state)
        amp.load_state_dict(state.data_position)  # the loss scale, under mixed precision
        self.losses = [float(v) for v in state.data_position["losses"]]
        return int(state.data_position["step"])

    @contextmanager
    def forward(self, step: int, micro: int) -> Iterator[None]:
        with self.tracer.span("forward", extra={"step": step, "micro": micro}), \
                self.slow.compute(self.delay_s):
            yield

    def backward(self, step: int, micro: int, layers: Iterable[int]) -> Iterator[int]:
        """The backward pass's layers, handed on one by one as the straggler's pace allows."""
        with self.tracer.span("backward", extra={"step": step, "micro": micro}):
            yield from self.slow.pieces(layers)

    def span(self, name: str, step: int) -> AbstractContextManager:
        return self.tracer.span(name, extra={"step": step})

    def end_step(self, step: int, loss: float, params: np.ndarray, opt: Optimizer, amp: Amp) -> bool:
        """After ``step``: the global loss and the stop vote in one all-reduce, a checkpoint if due.
        True when rank 0 voted to stop (every rank gets the same answer)."""
        spent = self.comm.rank == 0 and self.budget.spent()
        self.vote[:] = (loss, 1.0 if spent else 0.0)
        allreduce(self.comm, self.vote, self.sync.algorithm)
        self.losses.append(float(self.vote[0]))
        stop = bool(self.vote[1] > 0)
        self._check_finite(step, params, stop or step >= self.last_step)
        ckpt = self.sync.checkpoint
        if self.comm.rank == 0 and ckpt is not None and ckpt.due(step + 1):
            position = {"step": step + 1, "losses": self.losses, **amp.state_dict()}
            save_state(ckpt, step + 1, params, opt.state_dict(), position, self.expect.meta)
        return stop

    def _check_finite(self, step: int, params: np.ndarray, last: bool) -> None:
        """ConfigError if the weights are not finite, or if this last step's loss is not."""
        if not np.isfinite(params).all():
            raise ConfigError(f"step {step}: the parameters are inf or nan after the update (the loss was "
                              f"{self.losses[-1]:.3g}): the run diverged; lower the learning rate")
        if last and not math.isfinite(self.losses[-1]):
            raise ConfigError(f"step {step}: the loss of the last step is {self.losses[-1]}: the run "
                              "diverged; lower the learning rate")
