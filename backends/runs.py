"""Training runs behind ``dplab train`` and ``dplab compare``: data parallel vs single device.

Each run trains the same model from the same seed on the same global batches as
``reference.train.train_single`` and reports how far every rank's parameters end
from the single-device ones. That difference, ``max_abs_diff_vs_single``, is the
whole point: it should be at the level of float rounding (1e-16 in float64).

    from backends.runs import RunSpec, run_train
    row, events = run_train(RunSpec(world_size=4, algorithm="ring"))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.launch import World, check_backend, launch
from reference.async_ps import AsyncConfig, train_async
from reference.errors import ConfigError
from reference.replay import replay
from reference.sync import SyncConfig, train_sync
from reference.trace import Event
from reference.train import TrainConfig, evaluate, train_single

__all__ = ["RunSpec", "run_train", "train_rank", "MODES"]

MODES = ("sync", "async")


@dataclass(frozen=True)
class RunSpec:
    """One cell of a comparison: where and how to train ``train``."""

    backend: str = "local"
    world_size: int = 2
    algorithm: str = "ring"
    mode: str = "sync"
    staleness: int | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    bucket_cap_mb: float = 25.0
    accum_steps: int = 1

    def validate(self) -> None:
        check_backend(self.backend)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self.train.validate()
        if self.mode == "async":
            self.async_config().validate(self.world_size)
        else:
            SyncConfig(self.algorithm, self.bucket_cap_mb, self.accum_steps).validate()

    def async_config(self) -> AsyncConfig:
        return AsyncConfig(staleness=self.staleness)


def train_rank(comm: Any, spec: RunSpec, trace: bool) -> tuple[np.ndarray, Any, float, list[Event]]:
    """What every rank runs: sync or async training, timed, with its trace events.

    The second item is the per-step losses (sync) or the server's log (async).
    """
    comm.tracer.enabled = trace
    comm.barrier()
    t0 = time.perf_counter()
    if spec.mode == "async":
        result = train_async(comm, spec.train, spec.async_config())
        extra = result.log
    else:
        result = train_sync(comm, spec.train, SyncConfig(spec.algorithm, spec.bucket_cap_mb,
                                                         spec.accum_steps))
        extra = result.losses
    wall = time.perf_counter() - t0
    comm.tracer.enabled = False
    return result.params, extra, wall, comm.tracer.take()


def _bound(staleness: int | None) -> str:
    return "inf" if staleness is None else str(staleness)


def run_train(spec: RunSpec, world: World | None = None, trace: bool = False,
              single: np.ndarray | None = None) -> tuple[dict[str, Any], list[list[Event]]]:
    """Train on ``spec.world_size`` ranks; returns the result row and every rank's trace events."""
    spec.validate()
    if single is None:
        single = train_single(spec.train).params
    if world is not None and world.world_size != spec.world_size:
        raise ConfigError(f"world has {world.world_size} ranks but the spec asks for {spec.world_size}")
    if world is not None:
        results = world.run(train_rank, spec, trace)
    else:  # fresh ranks, or the ranks of mpiexec/torchrun when we run under one
        results = launch(train_rank, spec.world_size, spec.backend, args=(spec, trace))
    params = results[0][0]  # rank 0: a replica (sync) or the server (async)
    replicas = results if spec.mode == "sync" else results[:1]
    row = {
        "backend": spec.backend, "mode": spec.mode,
        "algorithm": spec.algorithm if spec.mode == "sync" else f"ps s={_bound(spec.staleness)}",
        "world_size": spec.world_size, "steps": spec.train.steps,
        "global_batch": spec.train.global_batch,
        "final_loss": float(evaluate(spec.train, params)),
        "max_abs_diff_vs_single": float(max(np.max(np.abs(r[0] - single), initial=0.0) for r in replicas)),
        "ranks_identical": all(np.array_equal(r[0], params) for r in replicas),
        "wall_s": max(r[2] for r in results),
    }
    if spec.mode == "async":  # the proof of an async run: its log replays to the same bits
        log = results[0][1]
        row["replay_exact"] = bool(np.array_equal(replay(spec.train, spec.async_config(), log), params))
        row["max_staleness"] = max((e.staleness for e in log), default=0)
    return row, [r[3] for r in results]
