"""What the parameter server, its workers and the replay agree on:
config, log, messages, arithmetic.

The roles live in ``dplab.reference.ps.trainer`` (the worker, and the overview) and
``dplab.reference.ps.server`` (the server); ``dplab.reference.ps.replay`` recomputes a run from its
log. They share the functions below so that the same inputs give the same bits.

Messages: a worker sends a header, int64 ``[kind, clock, version]``, to rank 0; a PULL
is answered with int64 ``[version, clock]`` and then the parameters, or with
``[STOP, STOP]`` and nothing else (the budget is spent, or, with backup workers, every
clock is done); a PUSH header is followed by the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.data import Dataset, batch_indices, shard
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP
from dplab.reference.ps.gate import gate_open
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.straggler import Stragglers, check_budget, check_delays, check_stragglers

__all__ = ["AsyncConfig", "LogEntry", "gate_open", "worker_batch", "compute_gradient", "combine",
           "update_gradient", "delay_of", "PULL", "PUSH", "STOP", "TAG_HEADER", "TAG_GRAD",
           "TAG_REPLY", "TAG_PARAMS"]

PULL, PUSH = 1, 2  # header kinds
STOP = -1  # a pull's answer that ends the worker's loop
TAG_HEADER, TAG_GRAD, TAG_REPLY, TAG_PARAMS = 11, 12, 13, 14


@dataclass(frozen=True)
class AsyncConfig:
    """How the parameter server trains: staleness, aggregation, delays, stragglers, budget.

    Args:
        staleness: how many clocks a worker may run ahead of the slowest; None: unbounded.
        clocks: clocks per worker; None: ``TrainConfig.steps``.
        aggregate: one summed update per clock (needs staleness 0).
        delays: seconds each worker sleeps before each compute, or None.
        max_delay_s: plus a random sleep in [0, max_delay_s).
        delay_seed: seeds the random sleeps.
        straggler: ((worker rank, factor), ...).
        time_budget_s: the server stops the workers once this much time is spent, or None.
        backup_workers: with ``aggregate``, a clock's update takes the first W - b gradients.
        checkpoint: where and how often the server saves, and what to resume from, or None.
        kill_at: tests only: (worker, clock) at which that worker kills itself.
    """

    # in CLOCKS: how far a worker may run ahead of the slowest; None: unbounded
    staleness: int | None = 0
    clocks: int | None = None  # clocks per worker; None: TrainConfig.steps
    aggregate: bool = False  # one summed update per clock (needs staleness=0): sync DP
    # seconds worker w sleeps before each compute: delays[w-1]
    delays: tuple[float, ...] | None = None
    max_delay_s: float = 0.0  # plus a random sleep in [0, max_delay_s), seeded by delay_seed
    delay_seed: int = 0
    straggler: Stragglers = ()  # ((worker rank, factor), ...): compute factor times slower
    time_budget_s: float | None = None  # the server stops the workers once this much time is spent
    # aggregate: a clock's update takes the first W - b gradients, drops the rest
    backup_workers: int = 0
    # the server checkpoints and resumes (checkpoint/resume.py)
    checkpoint: CheckpointConfig | None = None
    kill_at: tuple[int, int] | None = None  # tests only: (worker, clock): it SIGKILLs itself there

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def validate(self, world_size: int | None = None) -> None:
        """Refuse a configuration that cannot run, naming the field and the fix.

        Args:
            world_size: the number of ranks (the server and its workers), if known.

        Raises:
            ConfigError: a bad staleness, clocks, aggregation, backup workers, delays, stragglers,
                budget or checkpoint, or fewer than 2 ranks.
        """
        s = self.staleness
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ConfigError("staleness must be an integer >= 0, or None for fully asynchronous, "
                              f"got {s!r}")
        if self.clocks is not None and self.clocks < 0:
            raise ConfigError("clocks must be >= 0 (or None to use TrainConfig.steps), got "
                              f"{self.clocks}")
        if self.aggregate and s != 0:
            raise ConfigError(f"aggregate=True sums each clock's gradients, which needs lock-step "
                              f"workers: set staleness=0 (got {s!r}) or aggregate=False")
        self._validate_backup(world_size)
        check_delays(self.delays, None if world_size is None else world_size - 1, "worker")
        if not (math.isfinite(self.max_delay_s) and self.max_delay_s >= 0) or self.delay_seed < 0:
            raise ConfigError(f"need max_delay_s >= 0 and delay_seed >= 0, got {self.max_delay_s}, "
                              f"{self.delay_seed}")
        check_stragglers(self.straggler, world_size, first=1)
        check_budget(self.time_budget_s)
        if self.checkpoint is not None:
            self.checkpoint.validate()
        if world_size is not None and world_size < 2:
            raise ConfigError(f"the parameter server needs world_size >= 2 (rank 0 serves, ranks "
                              f"1.. work), got {world_size}: launch at least 2 ranks")

    def _validate_backup(self, world_size: int | None) -> None:
        b = self.backup_workers
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ConfigError(f"backup_workers must be an integer >= 0, got {b!r}")
        if b and not self.aggregate:
            raise ConfigError("backup_workers is a mode of lock-step aggregation: set "
                              "aggregate=True and staleness=0")
        if b and world_size is not None and b >= world_size - 1:
            raise ConfigError(
                f"backup_workers must be < the number of workers ({world_size - 1} "
                f"for world_size {world_size}), got {b}: each step needs one gradient"
            )


@dataclass(frozen=True)
class LogEntry:
    """One applied gradient, in the order the server applied it.

    Two different lags, in two different units (see the glossary in ``dplab.reference.ps``):
    ``clock - slowest_done`` is how far ahead of the slowest worker this gradient's worker
    ran, in CLOCKS: SSP's ``AsyncConfig.staleness`` bounds it. ``delay`` is how many other
    UPDATES landed between this gradient's pull and its own update: what makes it stale
    for the optimizer. With W workers and staleness s, delay <= (W - 1) x (2s + 1).

    Args:
        worker: the worker, 1..W.
        clock: its clock.
        version: the parameter version the gradient was computed on.
        produced: the version after applying it.
        slowest_done: the fewest clocks any worker had finished when this one's pull was answered.
    """

    worker: int  # 1..W
    clock: int
    version: int  # parameter version the gradient was computed on
    produced: int  # version after applying it (shared by a clock's gradients when aggregating)
    slowest_done: int  # min over workers of clocks done when this worker's pull was answered

    @property
    def delay(self) -> int:
        """In UPDATES: updates the server applied after the version this gradient was computed on
        and before its own (``produced - 1 - version``); 0 means it landed on fresh parameters."""
        return self.produced - 1 - self.version


def worker_batch(cfg: TrainConfig, worker: int, workers: int, clock: int) -> np.ndarray:
    """Worker w's samples at clock c: sync DP's shard of rank w - 1 at step c.

    Args:
        cfg: the run's configuration.
        worker: the worker's rank, 1..W.
        workers: W, the number of workers.
        clock: the clock.

    Returns:
        The sample indices.
    """
    return shard(
        batch_indices(cfg.num_samples, cfg.global_batch, clock, cfg.seed), worker - 1, workers
    )


def compute_gradient(model: MLP, data: Dataset, cfg: TrainConfig, params: np.ndarray,
                     idx: np.ndarray, grad: np.ndarray) -> float:
    """Overwrite ``grad`` with the shard's gradient (loss scale 1 / global_batch);
    returns the loss.

    Args:
        model: the MLP.
        data: the data set.
        cfg: the run's configuration.
        params: the parameters to differentiate at.
        idx: the shard's sample indices.
        grad: overwritten with the gradient.

    Returns:
        The shard's loss.
    """
    grad[:] = 0
    loss, _ = model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / cfg.global_batch, grad)
    return loss


def combine(grads: list[np.ndarray]) -> np.ndarray:
    """One gradient as it is; several summed left to right (the server's order, the replay's).

    Args:
        grads: one or more gradients.

    Returns:
        Their sum, in a new array.
    """
    total = grads[0].copy()
    for g in grads[1:]:
        total += g
    return total


def update_gradient(
    cfg: TrainConfig,
    acfg: AsyncConfig,
    workers: int,
    pushes: list[tuple[int, int]],
    grads: list[np.ndarray],
) -> np.ndarray:
    """The gradient one update applies: ``combine``d, and with backup workers rescaled.

    Each shard's gradient has loss scale 1 / global_batch, so the W shards of a clock sum
    to the full-batch mean gradient. With backup workers only some shards arrive; their
    sum is rescaled by global_batch / (samples in the shards that made it), so the step
    is the MEAN gradient over the samples actually used: W / (W - b) for even shards,
    and the step size of synchronous training. (Rescaling does not remove the bias: the
    mean is over the fast workers' samples, see ``dplab.reference.ps.trainer``.)

    Args:
        cfg: the run's configuration.
        acfg: the server's configuration.
        workers: the number of workers.
        pushes: (worker, clock) of each gradient.
        grads: the gradients, in the same order.

    Returns:
        The gradient to step with.
    """
    total = combine(grads)
    if acfg.backup_workers:
        used = sum(len(worker_batch(cfg, w, workers, c)) for w, c in pushes)
        if used:
            total *= cfg.global_batch / used
    return total


def delay_of(acfg: AsyncConfig, worker: int, clock: int) -> float:
    """Seconds worker ``worker`` sleeps before computing ``clock`` (tests use it to vary
    interleavings).

    Args:
        acfg: the server's configuration (``delays``, ``max_delay_s``, ``delay_seed``).
        worker: the worker.
        clock: the clock.

    Returns:
        Seconds; the same for the same arguments.
    """
    fixed = acfg.delays[worker - 1] if acfg.delays else 0.0
    if acfg.max_delay_s <= 0:
        return fixed
    return fixed + float(
        np.random.default_rng([acfg.delay_seed, worker, clock]).uniform(0, acfg.max_delay_s)
    )
