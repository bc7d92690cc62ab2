"""The Training page's runs: ``dplab compare``'s grid, made now, with what each run knew on the way.

    from dplab.viz.training_runs import TrainingGrid, run_grid
    cells = run_grid(TrainingGrid(world_size=4, steps=20))     # 10 runs and one more
    cells[0].row["final_loss"] == cells[0].losses[-1]           # True: the same number

Beside each cell's ``dplab compare`` row (from ``compare_specs`` and ``run_train`` on one
persistent local ``World``) this keeps what the run itself produced: its trace, its per-step
losses and, for the parameter server, its log. Nothing is re-enacted: a sync step's parameters
come from ONE more run of the same spec that checkpoints every step, which must end bit for bit
on every timed sync cell's final parameters (else ``ConfigError``), shown per step k as
``max |params_k - train_single(steps=k).params|``; a server version's parameters come from
``dplab.reference.ps.replay.replay`` of the log, at up to ``points`` versions. Losses are
``evaluate`` over the whole data set; times are the trace's, from the run's first traced event.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dplab.backends.launch.world import World
from dplab.backends.runs.grid import compare_specs
from dplab.backends.runs.run import RunSpec, run_train
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import list_checkpoints, load_checkpoint
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import LogEntry, worker_batch
from dplab.reference.trace import Event
from dplab.reference.train.single import TrainConfig, setup, train_single

__all__ = ["TrainingGrid", "Cell", "run_grid", "run_cell", "sync_steps", "fill_sync", "Progress"]

Progress = Callable[[int, int, str], None]  # (done, total, what just finished)


@dataclass(frozen=True)
class TrainingGrid:
    """One page's worth of runs: sync, backup workers and a staleness grid, each without and
    with a straggler (the last rank, ``straggler_factor`` times slower)."""

    world_size: int = 4  # the parameter server then has 3 workers
    steps: int = 20  # sync steps = clocks per worker
    staleness: tuple[int | None, ...] = (0, 2, None)  # None: unbounded
    backup_workers: tuple[int, ...] = (1,)
    straggler_factor: float = 8.0
    algorithm: str = "ring"
    hidden: tuple[int, ...] = (128,)  # wide enough that compute, which a straggler slows, shows
    num_samples: int = 2048
    global_batch: int = 512
    seed: int = 0
    points: int = 20  # most loss points per parameter-server curve (each is one replay of a prefix)
    cluster: str | None = None  # None: the local backend, measured; a name: the sim backend on it

    @property
    def backend(self) -> str:
        return "local" if self.cluster is None else "sim"

    def train_config(self) -> TrainConfig:
        return TrainConfig(model=MLPConfig(hidden=self.hidden), num_samples=self.num_samples,
                           global_batch=self.global_batch, steps=self.steps, seed=self.seed)

    def straggler(self) -> tuple[tuple[int, float], ...]:
        """The last rank: a worker of the parameter server too (rank 0 serves and computes
        nothing)."""
        return ((self.world_size - 1, float(self.straggler_factor)),)

    def specs(self) -> list[RunSpec]:
        """``dplab compare``'s cells (fixed steps), without then with the straggler."""
        if self.world_size < 3:
            raise ConfigError("the training page needs world_size >= 3 (a server and two workers, "
                              f"so one can straggle), got {self.world_size}")
        if self.straggler_factor < 1:
            raise ConfigError(f"straggler_factor must be >= 1, got {self.straggler_factor}")
        base = RunSpec(world_size=self.world_size, algorithm=self.algorithm,
                       train=self.train_config(), cluster=self.cluster)
        out = []
        for strag in ((), self.straggler()):
            out += compare_specs(
                replace(base, straggler=strag),
                [self.backend],
                [self.world_size],
                ["sync", "backup", "async"],
                [self.algorithm],
                list(self.staleness),
                list(self.backup_workers),
            )
        return out


@dataclass
class Cell:
    """One run: its row, and the curve that led there (``steps[i]``, ``times_s[i]``,
    ``losses[i]``)."""

    spec: RunSpec
    row: dict[str, Any]
    steps: list[float]  # global batches of gradients applied: a sync step, or W async updates
    times_s: list[float]  # seconds from the run's first traced event
    losses: list[float]  # mean loss over the whole data set at that point
    log: list[LogEntry] = field(default_factory=list)  # the server's (parameter server only)
    # sync: max |params_k - single_k|, k = 1..steps
    diffs: list[float] = field(default_factory=list)
    same_bits: bool | None = None  # sync: final params == the checkpointed run's, bit for bit
    params: np.ndarray | None = None  # final parameters (rank 0: a replica, or the server)

    @property
    def label(self) -> str:
        """The row's ``algorithm``: the all-reduce, ``ps s=2`` or ``ps backup b=1``."""
        return self.row["algorithm"]

    @property
    def straggler(self) -> str:
        return self.row["straggler"]

    @property
    def delays(self) -> list[int]:
        """Per applied gradient, in UPDATES (``LogEntry.delay``):
        not staleness, which counts clocks."""
        return [e.delay for e in self.log]


class _Recorder:
    """A World as ``run_train`` sees it, which also keeps the per-rank results it returns."""

    def __init__(self, world: World) -> None:
        self.world, self.world_size = world, world.world_size
        self.results: list[Any] = []

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        self.results = self.world.run(fn, *args)
        return self.results


def _loss(cfg: TrainConfig) -> Callable[[np.ndarray], float]:
    """``evaluate(cfg, params)`` with the data set made once: the same expression, the same bits."""
    model, data, _ = setup(cfg)
    return lambda params: float(
        model.loss(model.forward(params, data.x), data.y, scale=1 / cfg.num_samples)
    )


def _start_ns(events: list[list[Event]]) -> int:
    return min((e.t_start_ns for rank in events for e in rank), default=0)


def run_cell(spec: RunSpec, world: World, points: int = 20) -> Cell:
    """Train one cell through ``run_train`` (traced) and rebuild its curve from what it produced."""
    rec = _Recorder(world)
    row, events = run_train(spec, rec, trace=True)
    cfg, loss, t0 = spec.train, _loss(spec.train), _start_ns(events)
    initial = setup(cfg)[2]
    if spec.mode == "sync":
        ends: dict[int, int] = {}
        for e in (e for rank in events for e in rank if e.kind == "optimizer"):
            ends[e.extra["step"]] = max(ends.get(e.extra["step"], 0), e.t_end_ns)
        steps = list(range(len(ends) + 1))
        times = [0.0] + [(ends[k] - t0) / 1e9 for k in sorted(ends)]
        return Cell(
            spec, row, [float(s) for s in steps], times, [loss(initial)], params=rec.results[0][0]
        )
    log, _, _ = rec.results[0][1]
    workers, acfg = spec.world_size - 1, spec.async_config()
    applied = {e.extra["version"]: e.t_end_ns for e in events[0] if e.kind == "apply"}
    last = max((e.produced for e in log), default=0)
    n = min(points, last)
    cuts = sorted({round(i * last / n) for i in range(1, n + 1)}) if last else []
    cell = Cell(spec, row, [0.0], [0.0], [loss(initial)], log=log, params=rec.results[0][0])
    done = 0
    for v in cuts:
        prefix = [e for e in log if e.produced <= v]
        samples = sum(len(worker_batch(cfg, e.worker, workers, e.clock)) for e in prefix)
        cell.steps.append(samples / cfg.global_batch)
        cell.times_s.append((applied[v] - t0) / 1e9)
        cell.losses.append(loss(replay(cfg, acfg, prefix, workers)))
        done = v
    assert done == last
    return cell


def sync_steps(spec: RunSpec, world: World | None = None) -> list[np.ndarray]:
    """Per-step parameters of a sync spec: one more run (no straggler) that checkpoints every step.

    ``world``: a World of ``spec.world_size`` ranks to run on; None starts one for this run.
    """
    if world is None:
        with World(spec.world_size, spec.backend, cluster=spec.cluster) as fresh:
            return sync_steps(spec, fresh)
    with tempfile.TemporaryDirectory(prefix="dplab-viz-") as d:
        ckpt = CheckpointConfig(every=1, directory=d)
        run_train(replace(spec, straggler=(), checkpoint=ckpt), world)
        return [load_checkpoint(p).params for p in list_checkpoints(d).checkpoints]


def run_grid(grid: TrainingGrid, on_progress: Progress | None = None) -> list[Cell]:
    """Every cell of ``grid`` on one World (local, or sim on its cluster), then the sync cells'
    per-step equivalence."""
    specs = grid.specs()
    for spec in specs:
        spec.validate()  # bad input fails before any work
    cells: list[Cell] = []
    total = len(specs) + 1
    with World(grid.world_size, grid.backend, cluster=grid.cluster) as world:
        for spec in specs:
            cells.append(run_cell(spec, world, grid.points))
            if on_progress:
                on_progress(
                    len(cells), total, f"{cells[-1].label}, straggler {cells[-1].straggler}"
                )
        sync = [c for c in cells if c.row["mode"] == "sync"]
        if sync:
            fill_sync(sync, sync_steps(sync[0].spec, world), grid.train_config())
        if on_progress:
            on_progress(total, total, "per-step equivalence")
    return cells


def fill_sync(sync: list[Cell], params: list[np.ndarray], cfg: TrainConfig) -> None:
    """Losses and the per-step difference from one device, from the checkpointed run's parameters
    (``sync_steps``); every sync cell must have ended on the same bits as that run."""
    if len(params) != cfg.steps:
        raise ConfigError(f"the equivalence run left {len(params)} checkpoints for {cfg.steps} "
                          "steps")
    loss = _loss(cfg)
    losses = [loss(p) for p in params]
    diffs = [float(np.max(np.abs(p - train_single(replace(cfg, steps=k + 1)).params), initial=0.0))
             for k, p in enumerate(params)]
    for c in sync:
        c.same_bits = bool(np.array_equal(c.params, params[-1]))
        if not c.same_bits:
            raise ConfigError(f"sync run (straggler {c.straggler}) ended on other bits than the "
                              "checkpointed run of the same spec: the per-step curve would not be "
                              "its own")
        c.losses = c.losses[:1] + losses
        c.diffs = diffs
