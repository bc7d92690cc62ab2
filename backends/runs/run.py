"""Training runs behind ``dplab train`` and ``dplab compare``: data parallel vs single device.

Each run trains the same model from the same seed on the same global batches as
``dplab.reference.train.single.train_single`` and reports how far every rank's parameters end from
the single-device ones: ``max_abs_diff_vs_single``, float rounding (1e-16 in float64).

    from dplab.backends.runs import RunSpec, run_train
    row, events = run_train(RunSpec(world_size=4, algorithm="ring"))

Three modes: ``sync`` (all-reduce, ``dplab.reference.train.sync``), ``async`` (the parameter server
with bounded staleness) and ``backup`` (synchronous SGD through the parameter server, each step from
the first W - b gradients). Any of them may carry stragglers and a ``time_budget_s`` (train until it
is spent; ``train.steps`` is then the upper bound, and sync rows are checked against one device run
for as many steps). On the cuda backend, and on torch with ``--device cuda``, the sync recipe
computes on the rank's GPU with torch tensors (``compute_device``); elsewhere in NumPy. Rows hold
NumPy arrays.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dplab.backends.launch.world import RankLost, World, check_backend, launch, under_launcher
from dplab.backends.registry import entry
from dplab.backends.runs.memory import check_run
from dplab.reference.checkpoint.resume import CheckpointConfig, Expect, load_resume
from dplab.reference.errors import ConfigError
from dplab.reference.files import write_atomic
from dplab.reference.flops import ComputeHook
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.trace import Event
from dplab.reference.train.single import TrainConfig, evaluate, train_single
from dplab.reference.train.straggler import Stragglers
from dplab.reference.train.sync import SyncConfig, train_sync

if TYPE_CHECKING:  # the parameter server and ZeRO are imported where a run asks for them
    from dplab.reference.ps.trainer import AsyncConfig
    from dplab.reference.zero.train import ZeroConfig

__all__ = ["RunSpec", "run_train", "train_rank", "MODES", "straggler_label"]

MODES = ("sync", "async", "backup")


@dataclass(frozen=True)
class RunSpec:
    """One cell of a comparison: where and how to train ``train``.

    Attributes:
        backend: ``"local"``, ``"mpi"``, ``"torch"``, ``"cuda"`` or ``"sim"``.
        world_size: ranks (under ``"async"``: the server plus ``world_size - 1`` workers).
        algorithm: the all-reduce's name (sync and ZeRO runs).
        mode: ``"sync"``, ``"async"`` (parameter server) or ``"backup"`` (backup workers).
        staleness: the parameter server's bound in clocks; None is unbounded.
        train: the model, data, optimizer and steps (``dplab.reference.train.TrainConfig``).
        bucket_cap_mb: gradient bucket size of the sync recipe.
        accum_steps: micro-batches per step (gradient accumulation).
        straggler: ``((rank, factor), ...)``: ranks slowed by these factors.
        time_budget_s: train until this much wall time is spent, instead of ``train.steps``.
        backup_workers: mode ``"backup"`` only: gradients dropped per step.
        checkpoint: checkpoint every K steps / resume (``reference/checkpoint/resume.py``).
        zero_stage: sync only: train with ZeRO stage 0-3 (``reference/zero``) instead.
        precision: sync only: float16 compute, float32 masters, loss scaling.
        cluster: backend ``"sim"``: its cluster (a preset, ``<preset>xN``, a file).
    """

    backend: str = "local"
    world_size: int = 2
    algorithm: str = "ring"
    mode: str = "sync"
    staleness: int | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    bucket_cap_mb: float = 25.0
    accum_steps: int = 1
    straggler: Stragglers = ()  # ((rank, factor), ...)
    time_budget_s: float | None = None  # train until this much wall time is spent
    backup_workers: int = 1  # mode "backup" only: gradients dropped per step
    # checkpoint every K steps / resume (checkpoint/resume.py)
    checkpoint: CheckpointConfig | None = None
    zero_stage: int | None = None  # sync only: train with ZeRO stage 0-3 (reference/zero) instead
    # sync only: float16 compute, float32 masters, loss scaling
    precision: MixedPrecision | None = None
    cluster: str | None = None  # backend "sim": its cluster (a preset, <preset>xN, a file)

    def validate(self) -> None:
        """Refuse, in the launcher, a spec that cannot run; every rule of the configs it makes.

        Raises:
            ConfigError: the field that is wrong and what to do (an unknown backend or mode,
                ``cluster`` off the sim backend, mixed precision outside sync, a bad config).
            BackendUnavailable: the backend's engine is not installed.
        """
        check_backend(self.backend)
        if entry(self.backend).simulated:
            self.check_cluster()
        elif self.cluster is not None:
            raise ConfigError(f"--cluster names a simulated cluster: use --backend sim (not "
                              f"{self.backend}), or drop --cluster")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self.train.validate()
        if self.precision is not None and self.mode == "sync":
            # float32 masters: refused here, before any rank
            self.precision.validate(self.train.dtype)
        if self.zero_stage is not None:
            self.check_zero()
        elif self.mode == "sync":
            self.sync_config().validate(self.world_size)
            self.check_gpu()
        else:
            if self.precision is not None:
                raise ConfigError("mixed precision is for synchronous training: drop it, or use "
                                  f"--mode sync (not {self.mode})")
            self.async_config().validate(self.world_size)

    def simulated_cluster(self) -> Any:
        """The cluster a sim run runs on (``--cluster``, ``$DPLAB_CLUSTER``, or the default).

        Returns:
            A ``dplab.reference.cluster.Cluster``.
        """
        from dplab.backends.sim.setup import resolve_cluster  # the simulator, for sim runs only

        return resolve_cluster(self.cluster)

    def check_cluster(self) -> None:
        """The world fits the cluster, and what each rank holds fits its simulated device: its
        model state (the memory ledger's categories, by ``zero.memory``'s closed forms: under ZeRO
        the shards, and the layer it gathers), and its activations for one micro-batch.

        Raises:
            ConfigError: the world is larger than the cluster, or what a rank holds does not fit
                its device (by how much, and what to change).
        """
        from dplab.backends.runs.memory import activation_bytes, gathered_bytes
        from dplab.reference.model import MLP
        from dplab.reference.zero.memory import (
            model_state_bytes,
            precision_bytes,
            state_bytes_per_param,
        )

        c = self.simulated_cluster()
        c.check_world(self.world_size)
        precision = "mixed" if self.precision is not None else self.train.dtype
        b = precision_bytes(precision)
        stage = 0 if self.zero_stage is None else self.zero_stage
        state = state_bytes_per_param(self.train.optimizer.name, precision)
        need = model_state_bytes(MLP(self.train.model).num_params, stage, self.world_size,
                                 param_bytes=b.param_bytes, grad_bytes=b.grad_bytes,
                                 state_bytes=state)
        work = gathered_bytes(self) + activation_bytes(self, self.world_size)
        have = min(c.device_for(r).memory_bytes / c.ranks_sharing_device(self.world_size)
                   for r in range(self.world_size))
        if need.total + work > have:
            what = "replica" if stage == 0 else f"ZeRO-{stage} shard"
            gb = lambda x: f"{x / 1e9:.3g}"  # noqa: E731
            raise ConfigError(
                f"each rank's model {what} needs {gb(need.total + work)} GB (weights "
                f"{gb(need.params)}, gradients {gb(need.grads)}, optimizer {gb(need.optimizer)}, "
                f"activations and gathered layers {gb(work)}) but a rank of {c.name} has "
                f"{gb(have)} GB of {c.device.name}: {gb(need.total + work - have)} GB too many: "
                "use a higher --zero-stage, more ranks, a smaller model or a larger device")

    def on_gpu(self) -> bool:
        """Does the sync recipe compute on GPUs (torch tensors) in this run's ranks?

        Returns:
            True on the cuda backend, and on torch with ``DPLAB_DEVICE=cuda...``.
        """
        # --device: the torch backend's (cpu: gloo)
        device = os.environ.get("DPLAB_DEVICE") or "cpu"
        gpu = entry(self.backend).gpu
        return gpu == "always" or (gpu == "device" and device.startswith("cuda"))

    def check_gpu(self) -> None:
        """What works on NumPy arrays only is refused here for a run on GPUs, before any rank
        starts.

        Raises:
            ConfigError: checkpoints or mixed precision asked for on GPUs.
        """
        if self.on_gpu() and (self.checkpoint is not None or self.precision is not None):
            raise ConfigError(f"on the GPU (--backend {self.backend}) the recipe computes with "
                              "torch tensors, but checkpoints and mixed precision work on "
                              "NumPy arrays on the host: drop them, or use --backend local")

    def check_zero(self) -> None:
        """ZeRO runs the plain synchronous recipe: what only train_sync has is refused, with the
        fix.

        Raises:
            ConfigError: async modes, stragglers, time budgets or checkpoints asked with ZeRO, or
                a ``ZeroConfig`` that does not validate.
        """
        extras = {"--mode async/backup": self.mode != "sync", "--straggler": bool(self.straggler),
                  "--time-budget": self.time_budget_s is not None,
                  "checkpoints": self.checkpoint is not None}
        given = [name for name, on in extras.items() if on]
        if given:
            raise ConfigError(f"--zero-stage trains synchronously without {', '.join(given)}: drop "
                              f"{'it' if len(given) == 1 else 'them'}, or drop --zero-stage")
        self.zero_config().validate(self.world_size)

    def sync_config(self) -> SyncConfig:
        """The synchronous recipe's configuration.

        Returns:
            A ``SyncConfig`` from this spec's fields.
        """
        return SyncConfig(self.algorithm, self.bucket_cap_mb, self.accum_steps, self.straggler,
                          self.time_budget_s, checkpoint=self.checkpoint, precision=self.precision)

    def zero_config(self) -> ZeroConfig:
        """ZeRO's configuration (stage 0 when ``zero_stage`` is None).

        Returns:
            A ``ZeroConfig`` from this spec's fields.
        """
        from dplab.reference.zero.train import ZeroConfig

        stage = 0 if self.zero_stage is None else self.zero_stage
        return ZeroConfig(stage, self.algorithm, self.accum_steps, precision=self.precision)

    def async_config(self) -> AsyncConfig:
        """The parameter server's configuration (``"backup"``: lock-step, aggregating).

        Returns:
            An ``AsyncConfig`` from this spec's fields.
        """
        from dplab.reference.ps.trainer import AsyncConfig

        if self.mode == "backup":
            return AsyncConfig(staleness=0, aggregate=True, backup_workers=self.backup_workers,
                               straggler=self.straggler, time_budget_s=self.time_budget_s,
                               checkpoint=self.checkpoint)
        return AsyncConfig(staleness=self.staleness, straggler=self.straggler,
                           time_budget_s=self.time_budget_s, checkpoint=self.checkpoint)

    def check_resume(self) -> None:
        """Refuse a corrupt or foreign checkpoint here, in the launcher, before any rank starts.

        Raises:
            CheckpointError: the checkpoint is corrupt, or was written by another run's setup.
        """
        sync = self.mode == "sync"
        rules = self.sync_config() if sync else self.async_config()
        load_resume(self.checkpoint, Expect.of("sync" if sync else "async", self.train, rules,
                                               self.world_size, self.backend))

    def label(self) -> str:
        """The row's ``algorithm``: the all-reduce, or the parameter server's rule.

        Returns:
            E.g. ``"ring"``, ``"ring zero-2"``, ``"ps s=2"``, ``"ps backup b=1"``.
        """
        if self.mode == "sync":
            return (self.algorithm if self.zero_stage is None
                    else f"{self.algorithm} zero-{self.zero_stage}")
        if self.mode == "backup":
            return f"ps backup b={self.backup_workers}"
        return f"ps s={'inf' if self.staleness is None else self.staleness}"


def straggler_label(stragglers: Stragglers) -> str:
    """The row's ``straggler`` column.

    Args:
        stragglers: ``((rank, factor), ...)``.

    Returns:
        ``"rank:factor,..."``, or ``"none"``.
    """
    return ",".join(f"{r}:{f:g}" for r, f in stragglers) or "none"


def train_rank(comm: Any, spec: RunSpec, trace: bool) -> tuple[np.ndarray, Any, float, list[Event]]:
    """What every rank runs: sync or parameter-server training, timed, with its trace events.

    Args:
        comm: this rank's communicator.
        spec: the run.
        trace: record trace events.

    Returns:
        ``(params, extra, wall_s, events)``: this rank's final parameters; (per-step losses,
        ZeRO's measured memory or None) for sync, or the server's (log, dropped, lost) otherwise;
        the seconds it trained (virtual on a simulated cluster); its trace events.
    """
    comm.tracer.enabled = trace
    comm.barrier()
    t0 = comm.now()  # the wall's clock; on a simulated cluster, its virtual one
    with warnings.catch_warnings():
        # float16 overflows are expected: the loss scaler skips that step
        if spec.precision is not None:
            warnings.simplefilter("ignore", RuntimeWarning)
        result, extra = _train(comm, spec)
    wall = comm.now() - t0
    comm.tracer.enabled = False
    return result.params, extra, wall, comm.tracer.take()


def _train(comm: Any, spec: RunSpec) -> tuple[Any, Any]:
    if spec.zero_stage is not None:
        from dplab.reference.zero.train import train_zero

        result = train_zero(comm, spec.train, spec.zero_config())
        extra = result.losses, result.memory
    elif spec.mode == "sync":
        hooks = [ComputeHook(comm, spec.train, spec.accum_steps)] if comm.simulated else []
        result = train_sync(comm, spec.train, spec.sync_config(), hooks=hooks)  # sim: compute
        extra = result.losses, None
    else:
        from dplab.reference.ps.trainer import train_async

        result = train_async(comm, spec.train, spec.async_config())
        extra = (result.log, result.dropped, result.lost)
    return result, extra


def run_train(spec: RunSpec, world: World | None = None, trace: bool = False,
              single: np.ndarray | None = None,
              save_params: str | None = None) -> tuple[dict[str, Any], list[list[Event]]]:
    """Train on ``spec.world_size`` ranks; returns the result row and every rank's trace events.

    Args:
        spec: the run; validated here, before any rank starts.
        world: ranks to run on (a ``World`` of ``spec.world_size``); None starts fresh ones.
        trace: record every rank's trace events.
        single: the single-device run's parameters, when the caller has them already.
        save_params: also write rank 0's final parameters there (``np.save``, which adds
            ``.npy`` to a name without it), bit for bit, whole or not at all.

    Returns:
        ``(row, events)``: the result row (``final_loss``, ``max_abs_diff_vs_single``,
        ``ranks_identical``, ``wall_s``, ...) and each rank's trace events (empty lists unless
        ``trace``).

    Raises:
        ConfigError: a spec that cannot run, or a ``world`` of another size.
        WorldTooLarge: the world and its arrays do not fit this machine.
        CheckpointError: ``spec`` resumes from a corrupt or foreign checkpoint.
        WriteError: ``save_params`` cannot be written.
        RankError: a rank raised or died.
    """
    spec.validate()
    if not under_launcher(spec.backend):  # a launcher's ranks may span hosts: theirs to size
        check_run(spec)  # the world and its arrays fit in this host's memory, or one line
    if spec.checkpoint is not None and spec.checkpoint.resume is not None:
        spec.check_resume()
    if world is not None and world.world_size != spec.world_size:
        raise ConfigError(f"world has {world.world_size} ranks but the spec asks for "
                          f"{spec.world_size}")
    if world is not None:
        results = world.run(train_rank, spec, trace)
    else:  # fresh ranks, or the ranks of mpiexec/torchrun when we run under one
        workers = frozenset(range(1, spec.world_size)) if spec.mode == "async" else frozenset()
        cluster = spec.simulated_cluster() if entry(spec.backend).simulated else None
        results = launch(train_rank, spec.world_size, spec.backend, args=(spec, trace),
                         tolerate=workers, cluster=cluster)
    results = [r for r in results if not isinstance(r, RankLost)]  # async: the server went on
    params = results[0][0]  # rank 0: a replica (sync) or the server (parameter server)
    if save_params:
        target = save_params if str(save_params).endswith(".npy") else f"{save_params}.npy"
        write_atomic(target, lambda f: np.save(f, params), "--save-params")
    wall = max(r[2] for r in results)
    row = {
        "backend": spec.backend, "mode": spec.mode, "algorithm": spec.label(),
        "world_size": spec.world_size, "steps": spec.train.steps,
        "global_batch": spec.train.global_batch, "straggler": straggler_label(spec.straggler),
        "time_budget_s": spec.time_budget_s,
        "final_loss": float(evaluate(spec.train, params)),
    }
    if spec.mode == "sync":
        row |= sync_facts(spec, results, single)
    else:
        row |= server_facts(spec, results, single)
    row["wall_s"] = wall
    row["samples_per_s"] = row["samples"] / wall if wall > 0 else 0.0
    if entry(spec.backend).simulated:  # every time above is a simulated cluster's: say which
        cluster = spec.simulated_cluster()
        row |= {"cluster": cluster.name, "clock": "simulated", "cluster_about": cluster.describe(),
                "step_ms": wall / max(row["updates"], 1) * 1e3, "sim_s": wall}
    return row, [r[3] for r in results]  # (lost workers have no trace: they died)


def sync_facts(spec: RunSpec, results: list, single: np.ndarray | None) -> dict[str, Any]:
    """Every replica against the single-device run of as many steps as were taken; under ZeRO, the
    largest rank's measured peak bytes of model state (weights, gradients, optimizer state)."""
    steps = len(results[0][1][0])
    if single is None or steps != spec.train.steps:
        single = train_single(replace(spec.train, steps=steps)).params
    params = results[0][0]
    facts = {
        "updates": steps, "samples": steps * spec.train.global_batch,
        "max_abs_diff_vs_single": float(max(np.max(np.abs(r[0] - single), initial=0.0)
                                            for r in results)),
        "ranks_identical": all(np.array_equal(r[0], params) for r in results),
    }
    if spec.zero_stage is not None:  # only ZeRO measures its memory
        facts |= _peak_memory(results)
    return facts


def _peak_memory(results: list) -> dict[str, int]:
    reports = [r[1][1] for r in results if r[1][1] is not None]
    if not reports:
        return {}
    return {f"peak_{k}_bytes": max(getattr(m, k) for m in reports)
            for k in ("params", "grads", "optimizer", "total")}


def server_facts(spec: RunSpec, results: list, single: np.ndarray | None) -> dict[str, Any]:
    """The proof of a parameter-server run: its log replays to the same
    bits; who contributed what."""
    from dplab.reference.ps.replay import replay
    from dplab.reference.ps.trainer import worker_batch

    params, (log, dropped, lost) = results[0][0], results[0][1]
    workers, cfg, acfg = spec.world_size - 1, spec.train, spec.async_config()
    facts: dict[str, Any] = {
        "updates": max((e.produced for e in log), default=0),
        "samples": sum(len(worker_batch(cfg, e.worker, workers, e.clock)) for e in log),
        "replay_exact": bool(np.array_equal(replay(cfg, acfg, log, workers), params)),
        "max_delay": max((e.delay for e in log), default=0),  # in updates, not clocks
        "dropped": len(dropped),
        "applied_by_worker": {str(w): n for w, n in sorted(Counter(e.worker for e in log).items())},
        "ranks_identical": True,  # one server holds the parameters
        "lost_workers": {str(w): clocks for w, clocks in lost},  # dead worker -> clocks it finished
    }
    # same clocks as the single-device steps: the gap async costs
    if spec.time_budget_s is None and not lost:
        if single is None:
            single = train_single(cfg).params
        facts["max_abs_diff_vs_single"] = float(np.max(np.abs(params - single), initial=0.0))
    if spec.mode == "backup":
        facts["dropped_by_worker"] = {str(w): n
                                      for w, n in sorted(Counter(w for w, _ in dropped).items())}
    return facts
