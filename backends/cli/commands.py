"""The ``dplab`` command line: train, compare, bench, memory, tune, scaling (and app, lesson).

    dplab train --world-size 4 --algorithm ring --steps 50 --trace run.json
    dplab compare                                   # naive/ring/tree/native x 1..4 ranks
    dplab compare --modes sync,async --straggler 1:4  # 3 s each: sync, backup workers, async
    dplab bench --world-sizes 2 --sizes 4K,16M,64M
    dplab train --checkpoint-every 10 --checkpoint-dir ck   # then, after a crash: add --resume ck
    dplab app                                       # the visualizer, in your browser
    dplab memory --params 7B --world-sizes 8,64     # GB per rank of ZeRO stages 0-3 (formulas)
    dplab tune --backends local,mpi                 # fit alpha, beta, gamma for --algorithm auto

Every command prints a table; ``--json PATH`` writes the same rows as JSON.
Bad arguments get a one-line error and exit code 2. A command loads what it runs and no more
(``args.build_parser``); ``dplab app`` and ``dplab lesson`` come from viz/ and lessons/ by their
entry points and run themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from dplab.backends.cli.args import AUTO, build_parser
from dplab.backends.cli.args_optim import optim_config
from dplab.backends.cli.args_zero import master_dtype, precision_config
from dplab.backends.cli.checks import OutputPathError, check_args, stop_launcher_job
from dplab.backends.cli.table import format_number, format_table
from dplab.backends.launch.engine import launcher_env, launcher_rank, under_launcher
from dplab.backends.launch.interrupt import interruptible
from dplab.backends.launch.world import BackendUnavailable, RankError
from dplab.backends.runs.run import MODES, RunSpec, run_train
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import CheckpointError
from dplab.reference.errors import ConfigError
from dplab.reference.files import WriteError, write_atomic
from dplab.reference.model import MLPConfig
from dplab.reference.trace import merge, save_json, to_chrome
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.straggler import Stragglers

__all__ = ["main", "build_parser", "bench_argv"]

TRAIN_COLUMNS = ["backend", "mode", "algorithm", "world_size", "steps", "final_loss",
                 "max_abs_diff_vs_single", "ranks_identical", "wall_s"]
ASYNC_COLUMNS = [*TRAIN_COLUMNS, "max_delay", "replay_exact"]
RACE_COLUMNS = ["backend", "mode", "algorithm", "world_size", "straggler", "updates",
                "samples_per_s", "final_loss", "wall_s", "max_abs_diff_vs_single", "max_delay",
                "dropped", "replay_exact"]
LAUNCHER_GRACE_S = 2.0  # other ranks wait this long after an error every rank hits
UNLIMITED_STEPS = 10**9  # --steps under a time budget, unless given: the clock decides
BENCH_COLUMNS = ["backend", "algorithm", "world_size", "bytes", "time_us", "algbw_gbps",
                 "busbw_gbps", "vs_memcpy", "vs_native", "staged_bytes"]


def _train_config(a: argparse.Namespace, budget: float | None) -> TrainConfig:
    loss = "mse" if a.dataset == "regression" else "xent"
    model = MLPConfig(a.in_dim, tuple(a.hidden), a.out_dim, a.activation, loss)
    steps = a.steps if a.steps is not None else 50 if budget is None else UNLIMITED_STEPS
    return TrainConfig(model, a.dataset, a.num_samples, a.global_batch, steps,
                       optim_config(a), a.seed, master_dtype(a))


def _stragglers(a: argparse.Namespace) -> Stragglers:
    return tuple(pair for given in a.straggler for pair in given)


def cmd_train(a: argparse.Namespace) -> list[dict[str, Any]]:
    world_size = a.world_size
    if world_size is None:
        world_size = launcher_env(a.backend)[1] if under_launcher(a.backend) else 4
    budget = None if a.time_budget is AUTO else a.time_budget
    spec = RunSpec(a.backend, world_size, a.algorithm, a.mode, a.staleness,
                   _train_config(a, budget), a.bucket_cap_mb, a.accum_steps, _stragglers(a),
                   budget, a.backup_workers, _checkpoint(a), a.zero_stage, precision_config(a),
                   a.cluster)
    row, events = run_train(spec, trace=bool(a.trace),
                            save_params=a.save_params if _is_printer(a) else None)
    if a.trace and _is_printer(a):
        merged = merge(events)
        simulated = {"clock": "simulated", "cluster": row["cluster"]} if "cluster" in row else {}
        save_json(a.trace, merged, meta={"row": row, **simulated}, what="--trace")
        chrome = Path(a.trace).with_suffix(".chrome.json")
        write_atomic(chrome, json.dumps(to_chrome(merged, row.get("cluster", ""))).encode(),
                     "--trace (Chrome trace)")
        _say(f"trace: {a.trace} ({format_number(len(merged))} events); "
             f"Perfetto/chrome://tracing: {chrome}")
    return [row]


def _checkpoint(a: argparse.Namespace) -> CheckpointConfig | None:
    if not (a.checkpoint_every or a.checkpoint_dir or a.resume):
        return None
    return CheckpointConfig(a.checkpoint_every, a.checkpoint_dir, a.resume)


def cmd_compare(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The equivalence table (fixed steps), or, under a time budget, the race of sync and async."""
    from dplab.backends.cli.compare import run_specs
    from dplab.backends.cli.sweep import cmd_sweep, wants_sweep
    from dplab.backends.runs.grid import EQUIVALENCE_DEFAULTS, RACE_DEFAULTS, compare_specs

    if wants_sweep(a):  # --global-batches: the large-batch sweep (sweep.py)
        return cmd_sweep(a, _train_config)
    for mode in a.modes:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    budget = a.time_budget
    if budget is AUTO:
        budget = RACE_DEFAULTS["time_budget_s"] if "async" in a.modes else None
    defaults = RACE_DEFAULTS if budget is not None else EQUIVALENCE_DEFAULTS
    base = RunSpec(train=_train_config(a, budget), bucket_cap_mb=a.bucket_cap_mb,
                   accum_steps=a.accum_steps, straggler=_stragglers(a), time_budget_s=budget,
                   cluster=a.cluster)
    return run_specs(compare_specs(base, a.backends, a.world_sizes or defaults["world_sizes"],
                                   a.modes, a.algorithms or defaults["algorithms"],
                                   a.staleness_grid, a.backup_workers))


def cmd_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every backend x world size is one run with its own memcpy row
    (``checks`` vetted the rest)."""
    from dplab.backends.cli.checks import bench_spec
    from dplab.backends.cli.table import Progress
    from dplab.backends.launch.world import open_world

    spec, rows, progress = bench_spec(a), [], Progress(len(a.world_sizes) * len(a.backends))
    for backend in spec.backends:
        for p in spec.world_sizes:
            rows += spec.run(open_world, backend, p)
            progress.step(f"{backend} world size {p}")
    progress.close()
    return rows


def bench_argv(argv: list[str]) -> list[dict[str, Any]]:
    """``dplab bench argv``'s rows: parsed and checked as the command
    line does (``tune``'s bench)."""
    a = build_parser("bench").parse_args(["bench", *argv])
    check_args(a, printer=False)
    return cmd_bench(a)


def _columns(command: str, rows: list[dict[str, Any]]) -> list[str]:
    """The table shows what the rows are about: a race, stragglers, a parameter server."""
    if command == "bench":  # an auto row says what auto ran
        return _simulated(rows, [*BENCH_COLUMNS[:2], "ran", *BENCH_COLUMNS[2:]]
                          if any("ran" in r for r in rows) else BENCH_COLUMNS)
    if command == "tune":
        from dplab.backends.cli.tune import TUNE_COLUMNS

        return TUNE_COLUMNS
    if command == "scaling":
        from dplab.backends.cli.scaling import scaling_columns

        return _simulated(rows, scaling_columns(rows))
    if rows and "lr_rule" in rows[0]:
        from dplab.backends.cli.sweep import sweep_columns

        return sweep_columns(rows)
    return _simulated(rows, _train_columns(rows))


def _simulated(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """Rows of a simulated cluster name it, and their times are its: step_ms and sim_s."""
    sim = [r.get("clock") == "simulated" for r in rows]
    if not any(sim):
        return columns
    columns = list(columns)
    columns.insert(columns.index("backend") + 1, "cluster")
    if "wall_s" in columns:  # beside a real backend's rows, both clocks
        i = columns.index("wall_s")
        columns[i:i + 1] = ["step_ms", "sim_s"] if all(sim) else ["wall_s", "step_ms", "sim_s"]
    return columns


def _train_columns(rows: list[dict[str, Any]]) -> list[str]:
    if any(r.get("time_budget_s") is not None for r in rows):
        return RACE_COLUMNS
    columns = list(ASYNC_COLUMNS if any(r["mode"] != "sync" for r in rows) else TRAIN_COLUMNS)
    if any(r["mode"] == "backup" for r in rows):
        columns.insert(-1, "dropped")
    if any("peak_total_bytes" in r for r in rows):  # ZeRO: the measured peaks of model state
        columns[-1:-1] = ["peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes"]
    if any(r.get("straggler", "none") != "none" for r in rows):
        columns.insert(columns.index("world_size") + 1, "straggler")
    return columns


def _is_printer(a: argparse.Namespace) -> bool:
    """Under mpiexec/torchrun every rank runs this command; only rank 0 reports."""
    return launcher_rank() in (None, 0)  # compare and bench too, and a refused --backend local


def main(argv: list[str] | None = None) -> int:
    """Run the dplab command ``argv`` (default: the process's arguments) and return its exit code.

    Args:
        argv: the words after ``dplab``, e.g. ``["train", "--world-size", "4"]``.

    Returns:
        0, 2 for bad input (one line on stderr), 1 for a rank that failed, 130 for Ctrl-C;
        argparse exits 2 itself for options it cannot parse.
    """
    args = build_parser(_command_in(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    if "run" in args:  # a command from above backends/: the app's server, a lesson
        return args.run(args)
    if args.command == "memory":  # formulas, not a run: no backend, no ranks, no device
        from dplab.backends.cli.memory import run_memory

        return run_memory(args, argv)
    if not args.device:
        return _run(args, argv)
    saved = os.environ.get("DPLAB_DEVICE")
    os.environ["DPLAB_DEVICE"] = args.device  # read by the torch backend in every rank it starts
    try:
        return _run(args, argv)
    finally:  # called in-process (tests, scripts), the device of one command is not the next one's
        if saved is None:
            os.environ.pop("DPLAB_DEVICE", None)
        else:
            os.environ["DPLAB_DEVICE"] = saved


def _command_in(words: list[str]) -> str | None:
    """The command ``words`` name, so that only its parser is built.

    Args:
        words: the words after ``dplab``.

    Returns:
        The first word that is not an option (dplab's own options, ``--version`` and ``--help``,
        take no value), or None.
    """
    return next((w for w in words if not w.startswith("-")), None)


def cmd_tune(a: argparse.Namespace) -> list[dict[str, Any]]:
    """``dplab tune``: ``tune.cmd_tune`` (loaded now, with the cost model's fit) on ``dplab bench``.

    Args:
        a: the parsed options of ``dplab tune``.

    Returns:
        One row per fit: per backend, per backend and world size, per backend, world size
        and algorithm (``tune.LEVELS``).
    """
    from dplab.backends.cli.tune import cmd_tune as tune

    return tune(a, bench=bench_argv)


def cmd_scaling(a: argparse.Namespace) -> list[dict[str, Any]]:
    """``dplab scaling``: ``scaling.cmd_scaling``, loaded now (the traces' metrics, DDP's bench).

    Args:
        a: the parsed options of ``dplab scaling``.

    Returns:
        One row per backend, model and world size (with ``--ddp``: per implementation).
    """
    from dplab.backends.cli.scaling import cmd_scaling as scaling

    return scaling(a)


ROWS = {"train": cmd_train, "compare": cmd_compare, "bench": cmd_bench, "tune": cmd_tune,
        "scaling": cmd_scaling}  # the commands that make rows: the function that makes them


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """One command of train, compare, bench, tune, scaling: its rows,
    printed, or one line of error."""
    command = ROWS[args.command]
    try:
        check_args(args, _is_printer(args))
        if "auto" in [getattr(args, "algorithm", None), *(getattr(args, "algorithms", None) or [])]:
            from dplab.reference import auto  # the cost model loads for commands that ask for it

            auto.current()  # a bad $DPLAB_TUNE is one line here, not a traceback from every rank
        # Ctrl-C: one line, exit 130. Under torchrun or mpiexec, rank 0 says it for the job.
        rows = interruptible(f"dplab {args.command}", command, args, say=_is_printer(args))
    except (ConfigError, BackendUnavailable, CheckpointError) as e:
        if _is_printer(args):  # under a launcher every rank hits it: rank 0 says it once
            _say(f"dplab {args.command}: error: {e}", sys.stderr)
        else:  # rank 0 exits first, so the launcher stops us, not it before it could say why
            time.sleep(LAUNCHER_GRACE_S)
        if isinstance(e, OutputPathError):  # rank 0's alone: the other ranks must not wait for it
            stop_launcher_job(getattr(args, "backend", "local"), 2)
        return 2
    except RankError as e:
        message = e.config_error()
        if message is not None:  # the input or the machine, not a bug: one line, as above
            _say(f"dplab {args.command}: error: rank {e.rank}: {message}", sys.stderr)
            return 2
        _say(f"dplab {args.command}: {e}", sys.stderr)
        return 1
    if not _is_printer(args):
        return 0
    _say(format_table(rows, _columns(args.command, rows)))
    for about in dict.fromkeys(r["cluster_about"] for r in rows if r.get("clock") == "simulated"):
        _say(f"simulated time, not measured: {about}")
    if args.json:
        meta = {"command": args.command, "argv": sys.argv[1:] if argv is None else argv,
                "python": platform.python_version(), "machine": platform.machine()}
        try:
            write_atomic(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1).encode(),
                         "--json")
        except WriteError as e:  # the disk filled during the run: the table above still stands
            _say(f"dplab {args.command}: error: {e}", sys.stderr)
            return 2
        _say(f"rows written to {args.json}")
    return 0


def _say(text: str, stream: Any = None) -> None:
    """print, except that a reader who left (``dplab compare | head -3``) ends our output quietly.

    The rest of the output goes to /dev/null, so neither later prints nor the flush at exit
    raise again; the work itself (and ``--json``) still completes.
    """
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
