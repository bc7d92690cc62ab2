"""The synchronous trainer's configuration: the all-reduce, the buckets, micro-batches, extras.

    SyncConfig("tree", bucket_cap_mb=1, accum_steps=4)    # validated by train_sync, per world size
"""

from __future__ import annotations

from dataclasses import dataclass

from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.errors import ConfigError
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.train.straggler import Stragglers, check_budget, check_delays, check_stragglers

__all__ = ["SyncConfig"]


@dataclass(frozen=True)
class SyncConfig:
    """How the ranks reduce (algorithm, buckets, micro-batches) and what the run adds around it."""

    algorithm: str = "ring"  # naive | ring | tree | direct | native
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

    def validate(self, world_size: int | None = None) -> None:
        if not has_schedule(self.algorithm):
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
        if self.precision is not None:
            self.precision.validate()
