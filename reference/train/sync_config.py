"""The synchronous trainer's configuration: the all-reduce, the buckets, micro-batches, and hooks.

    SyncConfig("tree", bucket_cap_mb=1, accum_steps=4)    # validated by train_sync, per world size

The fields after ``accum_steps`` each attach a hook to the recipe (``SyncConfig.hooks``); left at
their defaults they attach none, and ``train_sync`` runs its five steps alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.algorithms.layout import resolve
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.precision.amp import Amp
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.train.checkpoints import Checkpoints
from dplab.reference.train.hooks import Hook, Hooks
from dplab.reference.train.single import TrainConfig
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

__all__ = ["SyncConfig"]


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
