"""The ``dplab`` command line: train, compare, bench.

    dplab train --world-size 4 --algorithm ring --steps 50 --trace run.json
    dplab compare                                   # naive/ring/tree/native x 1..4 ranks
    dplab compare --modes sync,async --straggler 1:4  # 3 s each: sync, backup workers, async
    dplab bench --world-sizes 2 --sizes 4K,16M,64M
    dplab train --checkpoint-every 10 --checkpoint-dir ck   # then, after a crash: add --resume ck

Every command prints a table; ``--json PATH`` writes the same rows as JSON.
Bad arguments get a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from dplab.backends.cli import bench
from dplab.backends.cli.compare import EQUIVALENCE_DEFAULTS, RACE_DEFAULTS, compare_specs, run_specs
from dplab.backends.cli.runs import MODES, RunSpec, run_train
from dplab.backends.cli.table import Progress, format_table
from dplab.backends.launch.world import (
    BackendUnavailable,
    RankError,
    World,
    check_backend,
    launcher_env,
    under_launcher,
)
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import CheckpointError
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.trace import merge, save_json, to_chrome
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.straggler import Stragglers, check_stragglers, parse_stragglers

__all__ = ["main"]

TRAIN_COLUMNS = ["backend", "mode", "algorithm", "world_size", "steps", "final_loss",
                 "max_abs_diff_vs_single", "ranks_identical", "wall_s"]
ASYNC_COLUMNS = [*TRAIN_COLUMNS, "max_staleness", "replay_exact"]
RACE_COLUMNS = ["backend", "mode", "algorithm", "world_size", "straggler", "updates", "samples_per_s",
                "final_loss", "wall_s", "max_abs_diff_vs_single", "max_staleness", "dropped",
                "replay_exact"]
UNLIMITED_STEPS = 10**9  # --steps under a time budget, unless given: the clock decides
AUTO = object()  # --time-budget not given: compare picks by --modes
BENCH_COLUMNS = ["backend", "algorithm", "world_size", "bytes", "time_us", "algbw_gbps",
                 "busbw_gbps", "vs_memcpy", "staged_bytes"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _csv(kind: type = str):
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None
    return parse


def _staleness(text: str) -> int | None:
    if text.lower() in ("inf", "none", "unbounded"):
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"staleness must be >= 0 or 'inf', got {value}")
    return value


def _budget(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"time budget must be seconds >= 0 or 'none', got {text}")
    return value


def _straggler(text: str) -> Stragglers:
    try:
        stragglers = parse_stragglers(text)
        check_stragglers(stragglers)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return stragglers


def _add_time_args(p: argparse.ArgumentParser, budget_help: str) -> None:
    g = p.add_argument_group("stragglers and time")
    g.add_argument("--straggler", type=_straggler, action="append", default=[], metavar="RANK:FACTOR",
                   help="slow RANK's compute FACTOR times (repeat, or 1:4,2:2); in async/backup "
                        "rank 0 is the server and cannot be slowed")
    g.add_argument("--time-budget", type=_budget, default=AUTO, metavar="SECONDS", help=budget_help)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--dataset", choices=["regression", "classification"], default="regression")
    g.add_argument("--hidden", type=_csv(int), default=[32, 32], help="hidden widths, e.g. 32,32")
    g.add_argument("--in-dim", type=int, default=16)
    g.add_argument("--out-dim", type=int, default=4)
    g.add_argument("--activation", choices=["tanh", "relu"], default="tanh")
    g.add_argument("--num-samples", type=int, default=1024)
    g.add_argument("--global-batch", type=int, default=64)
    g.add_argument("--steps", type=int, default=None,
                   help="steps (clocks per worker in async); default 50, or no limit under a time budget")
    g.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam")
    g.add_argument("--lr", type=float, default=0.01)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0)
    g.add_argument("--accum-steps", type=int, default=1, help="micro-batches per step")
    _add_common_args(p)


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="torch backend: gloo on CPU (default) or NCCL with one GPU per rank")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def _train_config(a: argparse.Namespace, budget: float | None) -> TrainConfig:
    loss = "mse" if a.dataset == "regression" else "xent"
    model = MLPConfig(a.in_dim, tuple(a.hidden), a.out_dim, a.activation, loss)
    steps = a.steps if a.steps is not None else 50 if budget is None else UNLIMITED_STEPS
    return TrainConfig(model, a.dataset, a.num_samples, a.global_batch, steps,
                       OptimConfig(a.optimizer, a.lr), a.seed, a.dtype)


def _stragglers(a: argparse.Namespace) -> Stragglers:
    return tuple(pair for given in a.straggler for pair in given)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dplab", description="Data-Parallel Lab: data parallelism written by hand.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train on N ranks and compare with one device")
    t.add_argument("--backend", default="local", help="local | mpi | torch")
    t.add_argument("--world-size", type=int, default=None,
                   help="ranks to start (default 4; under mpiexec/torchrun: the launcher's)")
    t.add_argument("--algorithm", default="ring", help="naive | ring | tree | direct | native")
    t.add_argument("--mode", choices=MODES, default="sync",
                   help="sync: all-reduce; async: parameter server; backup: synchronous through the "
                        "parameter server, each step from the first W - b gradients")
    t.add_argument("--staleness", type=_staleness, default=None,
                   help="async: clocks a worker may run ahead of the slowest (0 = lock-step; "
                        "default inf = fully asynchronous)")
    t.add_argument("--backup-workers", type=int, default=1, help="backup: gradients dropped per step")
    t.add_argument("--trace", metavar="PATH", help="write the merged trace (and PATH.chrome.json)")
    _add_time_args(t, "stop after this much wall time (default: none, train --steps)")
    g = t.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="write a checkpoint every K steps (async: K server updates)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go")
    g.add_argument("--resume", metavar="DIR", help="go on from DIR's latest checkpoint (or a file)")
    g.add_argument("--save-params", metavar="PATH", help="write the final parameters (.npy)")
    _add_model_args(t)

    c = sub.add_parser("compare", help="the same run over backends x algorithms x world sizes")
    c.add_argument("--backends", type=_csv(), default=["local"])
    c.add_argument("--algorithms", type=_csv(), default=None,
                   help="default naive,ring,tree,native (ring in a race)")
    c.add_argument("--world-sizes", type=_csv(int), default=None, help="default 1,2,3,4 (4 in a race)")
    c.add_argument("--modes", type=_csv(), default=["sync"],
                   help="sync,async,backup; with async (or a --time-budget) the cells race for the "
                        "same wall time, and sync brings the backup-worker rows along")
    c.add_argument("--staleness-grid", type=_csv(_staleness), default=RACE_DEFAULTS["staleness_grid"],
                   help="race: the async staleness bounds (default 0,2,inf)")
    c.add_argument("--backup-workers", type=_csv(int), default=RACE_DEFAULTS["backup_workers"],
                   help="race: b for each backup-worker row (default 1)")
    _add_time_args(c, f"a race: every cell trains this long (default {RACE_DEFAULTS['time_budget_s']:g} s "
                      "once async is in --modes, else none: a fixed --steps)")
    _add_model_args(c)

    b = sub.add_parser("bench", help="nccl-tests-style all-reduce bandwidth, memcpy as the ceiling")
    b.add_argument("--backends", "--backend", type=_csv(), default=["local"],
                   help="local,mpi,torch: several in one run put their rows side by side")
    b.add_argument("--algorithms", type=_csv(), default=["ring", "tree", "naive", "native"])
    b.add_argument("--world-sizes", type=_csv(int), default=[2])
    b.add_argument("--sizes", type=_csv(bench.parse_size), default=[4096, 1 << 20, 16 << 20, 64 << 20],
                   help="bytes per buffer, e.g. 4K,1M,16M,64M")
    b.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--target-seconds", type=float, default=0.3, help="timed work per cell")
    b.add_argument("--reps", type=int, default=5, help="timed loops per cell, algorithms interleaved")
    b.add_argument("--max-iters", type=int, default=2000)
    _add_common_args(b)
    return parser


def cmd_train(a: argparse.Namespace) -> list[dict[str, Any]]:
    world_size = a.world_size
    if world_size is None:
        world_size = launcher_env(a.backend)[1] if under_launcher(a.backend) else 4
    budget = None if a.time_budget is AUTO else a.time_budget
    spec = RunSpec(a.backend, world_size, a.algorithm, a.mode, a.staleness, _train_config(a, budget),
                   a.bucket_cap_mb, a.accum_steps, _stragglers(a), budget, a.backup_workers,
                   _checkpoint(a))
    row, events = run_train(spec, trace=bool(a.trace), save_params=a.save_params if _is_printer(a) else None)
    if a.trace and _is_printer(a):
        merged = merge(events)
        save_json(a.trace, merged, meta={"row": row})
        chrome = Path(a.trace).with_suffix(".chrome.json")
        chrome.write_text(json.dumps(to_chrome(merged)))
        print(f"trace: {a.trace} ({len(merged)} events); Perfetto/chrome://tracing: {chrome}")
    return [row]


def _checkpoint(a: argparse.Namespace) -> CheckpointConfig | None:
    if not (a.checkpoint_every or a.checkpoint_dir or a.resume):
        return None
    return CheckpointConfig(a.checkpoint_every, a.checkpoint_dir, a.resume)


def cmd_compare(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The equivalence table (fixed steps), or, under a time budget, the race of sync and async."""
    for mode in a.modes:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    budget = a.time_budget
    if budget is AUTO:
        budget = RACE_DEFAULTS["time_budget_s"] if "async" in a.modes else None
    defaults = RACE_DEFAULTS if budget is not None else EQUIVALENCE_DEFAULTS
    base = RunSpec(train=_train_config(a, budget), bucket_cap_mb=a.bucket_cap_mb,
                   accum_steps=a.accum_steps, straggler=_stragglers(a), time_budget_s=budget)
    return run_specs(compare_specs(base, a.backends, a.world_sizes or defaults["world_sizes"], a.modes,
                                   a.algorithms or defaults["algorithms"], a.staleness_grid,
                                   a.backup_workers))


def cmd_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    if a.reps < 1 or a.target_seconds <= 0 or a.warmup < 0:
        raise ConfigError("bench needs --reps >= 1, --target-seconds > 0 and --warmup >= 0")
    for backend in a.backends:
        check_backend(backend)
    rows, progress = [], Progress(len(a.world_sizes) * len(a.backends))
    for backend in a.backends:
        for p in a.world_sizes:
            with World(p, backend) as world:
                per_rank = world.run(bench.bench_rank, a.algorithms, a.sizes, a.dtype, a.warmup,
                                     a.target_seconds, a.max_iters, a.reps)
            rows += bench.summarize(backend, p, per_rank)
            progress.step(f"{backend} world size {p}")
    progress.close()
    memcpy = {r["bytes"]: r for r in rows if r["algorithm"] == "memcpy"}  # one ceiling row per size
    rows = [r for r in rows if r["algorithm"] != "memcpy"] + list(memcpy.values())
    return rows


def _columns(command: str, rows: list[dict[str, Any]]) -> list[str]:
    """The table shows what the rows are about: a race, stragglers, a parameter server."""
    if command == "bench":
        return BENCH_COLUMNS
    if any(r.get("time_budget_s") is not None for r in rows):
        return RACE_COLUMNS
    columns = list(ASYNC_COLUMNS if any(r["mode"] != "sync" for r in rows) else TRAIN_COLUMNS)
    if any(r["mode"] == "backup" for r in rows):
        columns.insert(-1, "dropped")
    if any(r.get("straggler", "none") != "none" for r in rows):
        columns.insert(columns.index("world_size") + 1, "straggler")
    return columns


def _is_printer(a: argparse.Namespace) -> bool:
    """Under mpiexec/torchrun every rank runs this command; only rank 0 reports."""
    backend = getattr(a, "backend", "local")
    return not under_launcher(backend) or launcher_env(backend)[0] == 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"train": cmd_train, "compare": cmd_compare, "bench": cmd_bench}[args.command]
    if args.device:  # read by the torch backend in every rank it starts
        os.environ["DPLAB_DEVICE"] = args.device
    try:
        rows = command(args)
    except (ConfigError, BackendUnavailable, CheckpointError) as e:
        print(f"dplab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        print(f"dplab {args.command}: {e}", file=sys.stderr)
        return 1
    if not _is_printer(args):
        return 0
    print(format_table(rows, _columns(args.command, rows)))
    if args.json:
        meta = {"command": args.command, "argv": sys.argv[1:] if argv is None else argv,
                "python": platform.python_version(), "machine": platform.machine()}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
