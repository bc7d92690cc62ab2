"""``dplab scaling``: strong scaling of synchronous training, and DDP's price against one process.

    dplab scaling                                   # small, 400k, 4M models x 1, 2, 4 ranks (local)
    dplab scaling --backends local,mpi --models 4M --world-sizes 1,2 --json scaling.json
    dplab scaling --ddp --backends local,mpi,torch  # DDP (ours, torch's) p=2 vs one process

The global batch (64) is split over p ranks, so a step on p ranks should take 1/p of one on one:

    speedup = T1 / Tp    efficiency = T1 / (p Tp)    (1: perfect; at p = 1 it is 1 by definition)

Each cell trains ``train_sync`` with tracing on and splits every rank's mean step into four
disjoint parts that add up to it (``dplab.reference.trace_metrics.step_split``): compute, exposed
communication, waiting and other. A row's parts are the mean over ranks of the median repetition;
cells are interleaved in worlds kept alive for the run, so compare ratios within one run. The
first ``--warmup`` steps of every run are left out. ``--ddp`` is ``scaling_ddp.py``.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from dataclasses import dataclass
from typing import Any

from dplab.backends.cli.args_optim import csv_list
from dplab.backends.cli.args_sim import add_cluster_arg
from dplab.backends.cli.scaling_ddp import DDP_COLUMNS, DdpBench, run_ddp
from dplab.backends.cli.table import Progress
from dplab.backends.launch.world import World, check_backend
from dplab.backends.registry import entry
from dplab.backends.runs.run import RunSpec, train_rank
from dplab.backends.sim.setup import resolve_cluster
from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.trace_metrics import StepSplit, step_split
from dplab.reference.train.single import TrainConfig

__all__ = ["add_scaling_parser", "cmd_scaling", "scaling_columns", "MODELS", "SCALING_COLUMNS",
           "ScalingRun", "scaling_rows", "split_rows"]

MODELS = {  # name -> MLP; parameters: 1,732 / 394,368 / 3,935,744
    "small": MLPConfig(16, (32, 32), 4),
    "400k": MLPConfig(128, (512, 512), 128),
    "4M": MLPConfig(512, (1536, 1536), 512),
}
SCALING_COLUMNS = ["backend", "model", "params", "world_size", "step_ms", "speedup", "efficiency",
                   "compute_ms", "exposed_comm_ms", "waiting_ms", "other_ms"]
SPLIT = ("step_ms", "compute_ms", "exposed_comm_ms", "waiting_ms", "other_ms")
EPILOG = """\
columns (strong scaling):
  step_ms          mean step of the median repetition, mean over ranks (warm-up steps left out)
  speedup          T1 / Tp: the same model's step on one rank over this one
  efficiency       T1 / (p Tp): 1 is perfect scaling
  compute_ms       forward, backward and optimizer spans (their union)
  exposed_comm_ms  reductions with no compute under them
  waiting_ms       blocked on the last bucket while neither computing nor reducing
  other_ms         the rest of the step: Python between phases; the four add up to step_ms
rows and columns (--ddp):
  single           one process on the 1/p batch: what every ratio divides by
  independent      p processes each on its 1/p batch, no communication: the machine's own floor
  dplab, torch_ddp our DDP on each backend; torch's DistributedDataParallel over gloo
  step_ms          the slowest rank's mean step (median repetition)
  ratio_vs_single  step_ms / single's step_ms (1: data parallelism cost nothing)
  cpu_ms           CPU time per step of one rank, all its threads (mean over ranks): the work,
                   which a busy machine inflates far less than the wall time
  load_1min        the machine's load average during the run: above the core count, wall times
                   measure the scheduler as much as the code
"""


@dataclass(frozen=True)
class ScalingRun:
    """What ``dplab scaling`` measures (everything but the backends and world sizes)."""

    models: tuple[str, ...] = tuple(MODELS)
    global_batch: int = 64
    steps: int = 12  # per run, warm-up included
    warmup: int = 2
    reps: int = 3
    algorithm: str = "ring"
    bucket_cap_mb: float = 25.0
    dtype: str = "float64"
    cluster: str | None = None  # backend "sim": the simulated cluster

    def validate(self, world_sizes: list[int]) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ConfigError(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
        if self.warmup < 0 or self.steps <= self.warmup or self.reps < 1:
            raise ConfigError(f"scaling needs --steps > --warmup >= 0 and --reps >= 1, got --steps "
                              f"{self.steps} --warmup {self.warmup} --reps {self.reps}")
        if any(p < 1 for p in world_sizes):
            raise ConfigError(f"world sizes must be >= 1, got {','.join(map(str, world_sizes))}")
        if self.global_batch < max(world_sizes):
            raise ConfigError(f"--global-batch {self.global_batch} is less than world size "
                              f"{max(world_sizes)}: every rank needs a sample; raise "
                              "--global-batch")
        if not has_schedule(self.algorithm):
            raise ConfigError(f"unknown algorithm {self.algorithm!r}: choose from "
                              f"{', '.join(ALGORITHMS)}")

    def spec(self, backend: str, model: str, world_size: int) -> RunSpec:
        train = TrainConfig(MODELS[model], "regression", max(256, self.global_batch),
                            self.global_batch, self.steps, seed=0, dtype=self.dtype)
        return RunSpec(backend, world_size, self.algorithm, train=train,
                       bucket_cap_mb=self.bucket_cap_mb,
                       cluster=self.cluster if entry(backend).simulated else None)


def split_rows(per_rank: list[Any], warmup: int) -> dict[str, float]:
    """The mean over ranks of each rank's step split (``train_rank``'s
    results, with their traces)."""
    splits: list[StepSplit] = [step_split(r[3], first_step=warmup) for r in per_rank]
    return {k: statistics.fmean(getattr(s, k) for s in splits) for k in SPLIT}


def scaling_rows(cells: dict[tuple[str, str, int], list[dict[str, float]]],
                 clusters: dict[str, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """Rows from ``{(backend, model, p): [split per repetition]}``: the median repetition's split,
    speedup and efficiency against the same backend and model at p = 1 (None without one).
    ``clusters``: a simulated backend's cluster fields, added to its rows."""
    rows, clusters = [], clusters or {}
    for (backend, model, p), reps in cells.items():
        ordered = sorted(reps, key=lambda s: s["step_ms"])
        rows.append({"backend": backend, "model": model, "params": MLP(MODELS[model]).num_params,
                     "world_size": p, **ordered[(len(ordered) - 1) // 2], "reps": len(reps),
                     "step_ms_each": [s["step_ms"] for s in reps], **clusters.get(backend, {})})
    one = {(r["backend"], r["model"]): r["step_ms"] for r in rows if r["world_size"] == 1}
    for r in rows:
        t1 = one.get((r["backend"], r["model"]))
        r["speedup"] = t1 / r["step_ms"] if t1 is not None else None
        r["efficiency"] = t1 / (r["world_size"] * r["step_ms"]) if t1 is not None else None
    return rows


def run_scaling(run: ScalingRun, backends: list[str],
                world_sizes: list[int]) -> list[dict[str, Any]]:
    """Every backend x world size a world alive for the whole run; the cells
    interleaved per repetition."""
    keys = [(b, m, p) for b in backends for m in run.models for p in world_sizes]
    cells: dict[tuple[str, str, int], list[dict[str, float]]] = {k: [] for k in keys}
    progress = Progress(run.reps * len(keys))
    worlds = {}
    try:
        for b in backends:
            for p in world_sizes:
                simulated = entry(b).simulated
                worlds[b, p] = World(p, b, cluster=run.spec(b, run.models[0], p).simulated_cluster()
                                     if simulated else None)
        for rep in range(run.reps):
            for b, m, p in keys:
                if rep and entry(b).simulated:  # a simulated cell is the same every time
                    progress.step(f"{b} {m} p={p}")
                    continue
                per_rank = worlds[b, p].run(train_rank, run.spec(b, m, p), True)
                cells[b, m, p].append(split_rows(per_rank, run.warmup))
                progress.step(f"{b} {m} p={p}")
    finally:
        for w in worlds.values():
            w.close()
        progress.close()
    return scaling_rows(cells, {b: _about(run.spec(b, run.models[0], 1).simulated_cluster())
                                for b in backends if entry(b).simulated})


def _about(c: Any) -> dict[str, str]:
    return {"cluster": c.name, "clock": "simulated", "cluster_about": c.describe()}


def _dims(m: MLPConfig) -> str:
    return "-".join(map(str, (m.in_dim, *m.hidden, m.out_dim)))


def add_scaling_parser(sub: Any,
                       formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register ``dplab scaling`` on the subparsers ``sub`` (args.py
    passes its formatter: one style)."""
    s = sub.add_parser("scaling",
                       help="strong scaling of synchronous training; --ddp: DDP vs one process",
                       formatter_class=formatter_class, epilog=EPILOG,
                       description=textwrap.fill(
                           "Train the same global batch on 1, 2, 4 ranks and report the "
                           "speedup, the efficiency T1/(p Tp) and where each step's time goes "
                           "(compute, exposed communication, waiting), from the traces. With "
                           "--ddp: a step of DDP for torch modules on p ranks against one process "
                           "on the 1/p batch, and torch's own DDP over gloo, side by side.", 88))
    s.add_argument("--backends", "--backend", type=csv_list(str, what="backend"), default=["local"],
                   help="local,mpi,torch: several in one run put their rows side by side")
    s.add_argument("--models", type=csv_list(str, what="model"), default=list(MODELS),
                   help="MLPs to train: " + ", ".join(f"{k} {_dims(v)}" for k, v in MODELS.items()))
    s.add_argument("--world-sizes", type=csv_list(int, what="world size"), default=None,
                   help="ranks per run (default: 1,2,4; on a simulated --cluster, its powers "
                        "of two up to 64; with --ddp: 2)")
    s.add_argument("--global-batch", type=int, default=64,
                   help="samples per step, split over the ranks")
    s.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    s.add_argument("--warmup", type=int, default=2,
                   help="first steps of each run left out of the timing")
    s.add_argument("--reps", type=int, default=None,
                   help="repetitions of every cell, interleaved; the median (default: 3; on a "
                        "simulated cluster alone, 1: every repetition gives the same time)")
    s.add_argument("--algorithm", default="ring", help="the all-reduce of the gradient buckets")
    s.add_argument("--bucket-cap-mb", type=float, default=25.0, metavar="MiB",
                   help="gradient bucket size")
    s.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="parameters and gradients of the reference trainer (--ddp trains "
                        "in float32)")
    s.add_argument("--ddp", action="store_true",
                   help="measure DDP for torch modules (a 10.5 M-parameter MLP, SGD) instead "
                        "(default: off, strong scaling)")
    s.add_argument("--device", choices=["cpu"], default=None,
                   help="torch backend: gloo on the CPU (default: cpu)")
    s.add_argument("--json", metavar="PATH",
                   help="also write the rows as JSON (default: not written)")
    add_cluster_arg(s)
    return s


def cmd_scaling(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Checks everything first (a bad argument is one line and exit 2, before any rank starts)."""
    for b in a.backends:
        check_backend(b)
    if not a.bucket_cap_mb > 0:
        raise ConfigError(f"--bucket-cap-mb must be > 0, got {a.bucket_cap_mb}")
    if a.reps is None:  # a simulated clock is deterministic: a second repetition adds nothing
        a.reps = 1 if all(entry(b).simulated for b in a.backends) else 3
    if a.ddp:
        world_sizes = a.world_sizes or [2]
        cfg = DdpBench(global_batch=a.global_batch, steps=a.steps - a.warmup, warmup=a.warmup,
                       bucket_cap_mb=a.bucket_cap_mb, algorithm=a.algorithm, cluster=a.cluster)
        ScalingRun(reps=a.reps, steps=a.steps, warmup=a.warmup, global_batch=a.global_batch,
                   algorithm=a.algorithm).validate(world_sizes)
        return run_ddp(cfg, a.backends, world_sizes, a.reps)
    run = ScalingRun(tuple(a.models), a.global_batch, a.steps, a.warmup, a.reps, a.algorithm,
                     a.bucket_cap_mb, a.dtype, a.cluster)
    world_sizes = a.world_sizes or _default_world_sizes(a.backends, a.cluster)
    run.validate(world_sizes)
    for b in a.backends:  # every cell's run checked first: a bad cluster or world is one line now
        for p in world_sizes:
            for m in run.models:
                run.spec(b, m, p).validate()
    return run_scaling(run, a.backends, world_sizes)


def _default_world_sizes(backends: list[str], cluster: str | None) -> list[int]:
    """1, 2, 4; on a simulated cluster alone, every power of two it holds (up to 64)."""
    if not all(entry(b).simulated for b in backends):
        return [1, 2, 4]
    size = min(resolve_cluster(cluster).size, 64)
    return [1 << k for k in range(size.bit_length()) if 1 << k <= size]


def scaling_columns(rows: list[dict[str, Any]]) -> list[str]:
    return DDP_COLUMNS if rows and "impl" in rows[0] else SCALING_COLUMNS
