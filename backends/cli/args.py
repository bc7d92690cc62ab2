"""The ``dplab`` argument parser: every option explained, with its default.

    dplab --version
    dplab train --help          # likewise compare --help, bench --help

Values are checked as they are parsed where one value alone can be wrong (a NaN bucket
cap, an empty list); checks that need several values, the file system or the machine's
memory live in ``checks.py``. Both end in one line on stderr and exit code 2.

``build_parser(command)`` builds the parser of the command about to run and imports nothing of
the others: ``dplab train`` pays neither for ``bench``'s spec nor for ``tune``'s cost model.
The commands whose code lives above backends/ (``dplab app`` in viz/, ``dplab lesson`` in
lessons/) are entry points of the group ``dplab.commands`` (pyproject.toml): imports run down
the house, so the command line looks them up instead of importing them.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dplab.backends.cli.args_optim import (
    add_optimizer_args,
    add_sweep_args,
    positive_float,
    positive_int,
)
from dplab.backends.cli.args_optim import csv_list as _csv
from dplab.backends.cli.args_sim import add_cluster_arg
from dplab.backends.cli.args_zero import add_zero_args, precision_flags_error
from dplab.backends.runs.run import MODES
from dplab.reference.algorithms import ALGORITHMS, PARAMETRIC
from dplab.reference.errors import ConfigError
from dplab.reference.train.straggler import Stragglers, check_stragglers, parse_stragglers

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["build_parser", "upper_commands", "dplab_version", "AUTO", "TRAIN_BUCKET_CAP_MB",
           "BENCH_EPILOG", "COMMANDS", "UPPER_COMMANDS"]

AUTO = object()  # --time-budget not given: compare picks by --modes
# The default MLP (16-32-32-4, float64 or float32) has per-layer gradients of 1-8 KiB: DDP's 25 MB
# puts them all in one bucket, reduced after backward ends, and the trace shows no overlap. A
# cap of 0.0005 MiB (524 bytes) closes a bucket after each layer: 3 buckets, the first reduced
# while the earlier layers' backward still runs.
TRAIN_BUCKET_CAP_MB = 0.0005
DDP_BUCKET_CAP_MB = 25.0

BENCH_EPILOG = """\
columns:
  time_us     mean time of one all-reduce (loop mean, median over --reps, mean over ranks)
  algbw_gbps  algorithm bandwidth: bytes / time, the buffer size over the time one all-reduce takes.
  busbw_gbps  bus bandwidth: algbw x 2(p-1)/p for all-reduce (nccl-tests' convention), what each
              rank's link carried, comparable across world sizes and with a memory copy.
  vs_memcpy   busbw / the busbw of the memcpy row of the same run (backend x world size).
  vs_native   this algorithm's busbw / the busbw of the engine's own all-reduce (MPI_Allreduce,
              dist.all_reduce; local: the one-shot shared-memory one) at the same backend, world
              size and bytes, in the same run: above 1 is faster than the engine. Needs 'native'
              in --algorithms.
  memcpy row  one core's np.copyto of the same bytes, timed by rank 0 inside each backend x world
              size run: the ceiling of any shared-memory transport, and what vs_memcpy divides by.
"""


def dplab_version() -> str:
    """The installed distribution's version (importlib.metadata), as ``pip show dplab`` says."""
    from importlib.metadata import PackageNotFoundError, version  # slow to import: --version only

    try:
        return version("dplab")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


class _Parser(argparse.ArgumentParser):
    """One-line errors, exit 2. ``checks``: functions of the parsed options that return why they
    contradict each other, or None; run after parsing, so the options' order does not matter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], str | None]] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            problem = check(parsed)
            if problem:
                self.error(problem)
        return parsed, rest

    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _wrap(text: str) -> str:
    """Descriptions wrapped by hand: the formatter keeps the bench
    column table's layout as written."""
    return textwrap.fill(text, 88)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join("inf" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
                        for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to every option whose help does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text and action.default is not None
                and action.default is not argparse.SUPPRESS and action.default is not AUTO):
            text += f" (default: {_shown(action.default)})".replace("%", "%%")
        return text


def _size(text: str) -> int:
    from dplab.backends.bench.timing import parse_size

    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: bytes, or with K, M or G"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least one element, got {text!r}")
    return value


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
    g.add_argument("--straggler", type=_straggler, action="append", default=[],
                   metavar="RANK:FACTOR",
                   help="slow RANK's compute FACTOR times (repeat, or 1:4,2:2); in async/backup "
                        "rank 0 is the server and cannot be slowed (default: none)")
    g.add_argument("--time-budget", type=_budget, default=AUTO, metavar="SECONDS", help=budget_help)


def _add_model_args(p: argparse.ArgumentParser, bucket_cap_mb: float, bucket_help: str) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--dataset", choices=["regression", "classification"], default="regression",
                   help="synthetic data: regression (MSE loss) or classification (cross-entropy)")
    g.add_argument("--hidden", type=_csv(int, empty_ok=True), default=[32, 32],
                   help="hidden layer widths of the MLP; '' for none (a linear model)")
    g.add_argument("--in-dim", type=int, default=16, help="input features")
    g.add_argument("--out-dim", type=int, default=4, help="outputs (classes for classification)")
    g.add_argument("--activation", choices=["tanh", "relu"], default="tanh",
                   help="hidden activation")
    g.add_argument("--num-samples", type=int, default=1024, help="size of the synthetic data set")
    g.add_argument("--global-batch", type=int, default=64,
                   help="samples per step over all ranks, split across them (uneven "
                        "splits allowed)")
    g.add_argument("--steps", type=int, default=None,
                   help="steps (clocks per worker in async); default 50, or no limit under a "
                        "time budget")
    add_optimizer_args(g)  # --optimizer, --lr, --warmup-steps, --trust-coef, --weight-decay
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the data, the initial weights, the batches")
    g.add_argument("--dtype", choices=["float64", "float32"], default=None,
                   help="parameters and gradients (default: float64; float32 under "
                        "--mixed-precision)")
    g.add_argument("--bucket-cap-mb", type=positive_float, default=bucket_cap_mb, metavar="MiB",
                   help=bucket_help)
    g.add_argument("--accum-steps", type=positive_int, default=1,
                   help="micro-batches per step; all but the last skip the all-reduce (no_sync)")
    _add_common_args(p,
                     "torch backend: gloo on CPU or NCCL with one GPU per rank (default: cpu, or "
                        "$DPLAB_DEVICE)")


def _add_common_args(p: argparse.ArgumentParser, device_help: str) -> None:
    g = p.add_argument_group("device and output")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help=device_help)
    g.add_argument("--json", metavar="PATH",
                   help="also write the rows, with full precision, as JSON (default: not written)")
    add_cluster_arg(g)


def _add_train(sub: Any) -> None:  # run by commands.cmd_train
    t = sub.add_parser("train", help="train on N ranks and compare with one device",
                       formatter_class=_Formatter,
                       description=_wrap("Train one MLP on N ranks and report how far every rank's "
                                         "parameters end from single-device training on the "
                                         "same batches."))
    t.add_argument("--backend", default="local",
                   help="local | mpi | torch | cuda | sim (cuda, and torch with --device cuda: the "
                        "recipe computes on the GPU with torch tensors; elsewhere in NumPy on the "
                        "host; sim: on a simulated --cluster, its time)")
    t.add_argument("--world-size", type=int, default=None,
                   help="ranks to start (default 4; under mpiexec/torchrun: the launcher's)")
    t.add_argument("--algorithm", default="ring",
                   help=" | ".join(f"{a}[:N]" if a in PARAMETRIC else a
                                   for a in (*ALGORITHMS, "auto")))
    t.add_argument("--mode", choices=MODES, default="sync",
                   help="sync: all-reduce; async: parameter server; backup: synchronous "
                        "through the parameter server, each step from the first W - b of its W "
                        "workers' gradients (b: --backup-workers)")
    t.add_argument("--staleness", type=_staleness, default=None,
                   help="async: clocks a worker may run ahead of the slowest (0 = lock-step; "
                        "default inf = fully asynchronous)")
    t.add_argument("--backup-workers", type=int, default=1,
                   help="backup: gradients dropped per step")
    t.add_argument("--trace", metavar="PATH",
                   help="write the merged trace (and PATH.chrome.json for Perfetto) (default: "
                        "no trace)")
    _add_time_args(t, "stop after this much wall time (default: none, train --steps)")
    g = t.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="write a checkpoint every K steps (async: K server updates); 0 = never")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="where checkpoints go; its parent directory must exist (default: none)")
    g.add_argument("--resume", metavar="DIR",
                   help="go on from DIR's latest checkpoint (or a file) (default: start afresh); "
                        "the same backend, world size, algorithm and model, and --steps at least "
                        "the checkpoint's, or it is refused")
    g.add_argument("--save-params", metavar="PATH",
                   help="write the final parameters (.npy) (default: not written)")
    add_zero_args(t)  # --zero-stage, --mixed-precision, --loss-scale, --reduce-dtype
    t.checks.append(precision_flags_error)
    _add_model_args(t, TRAIN_BUCKET_CAP_MB,
                    "gradient bucket size; a bucket's all-reduce starts as soon as its "
                    "gradients exist, while backward goes on. The default, 0.0005 MiB (524 bytes), "
                    "puts the default MLP's gradients in 3 buckets, one per layer, so a --trace "
                    "shows the first bucket's all-reduce overlapping backward; torch DDP's "
                    f"{DDP_BUCKET_CAP_MB:g} would make it one bucket, reduced after backward ends")


def _add_compare(sub: Any) -> None:  # run by commands.cmd_compare
    from dplab.backends.runs.grid import RACE_DEFAULTS

    c = sub.add_parser("compare", help="the same run over backends x algorithms x world sizes",
                       formatter_class=_Formatter,
                       description=_wrap("The same training run over a grid of backends x "
                                         "algorithms x world sizes (x modes): an equivalence "
                                         "table, or a race for the same wall time."))
    c.add_argument("--backends", type=_csv(), default=["local"],
                   help="comma-separated: local,mpi,torch,cuda")
    c.add_argument("--algorithms", type=_csv(), default=None,
                   help=f"all-reduce algorithms, from {', '.join((*ALGORITHMS, 'auto'))}; "
                        "default naive,ring,tree,native (ring in a race)")
    c.add_argument("--world-sizes", type=_csv(int), default=None,
                   help="default 1,2,3,4 (4 in a race)")
    c.add_argument("--modes", type=_csv(), default=["sync"],
                   help="sync,async,backup; with async (or a --time-budget) the cells race for the "
                        "same wall time, and sync brings the backup-worker rows along")
    c.add_argument("--staleness-grid", type=_csv(_staleness),
                   default=RACE_DEFAULTS["staleness_grid"], help="race: the async staleness bounds")
    c.add_argument("--backup-workers", type=_csv(int), default=RACE_DEFAULTS["backup_workers"],
                   help="race: b for each backup-worker row")
    _add_time_args(c,
                   "a race: every cell trains this long (default "
                   f"{RACE_DEFAULTS['time_budget_s']:g} s "
                      "once async is in --modes, else none: a fixed --steps)")
    _add_model_args(c, DDP_BUCKET_CAP_MB, "gradient bucket size, as torch DDP's bucket_cap_mb")
    add_sweep_args(c)


def _add_bench(sub: Any) -> None:  # run by commands.cmd_bench
    from dplab.backends.bench.spec import BenchSpec

    b = sub.add_parser("bench", help="nccl-tests-style all-reduce bandwidth, memcpy as the ceiling",
                       formatter_class=_Formatter, epilog=BENCH_EPILOG,
                       description=_wrap("Time all-reduce algorithms on every backend x world "
                                         "size x buffer size, nccl-tests style, against the "
                                         "engine's own all-reduce and a memory copy."))
    d = BenchSpec()  # the command's defaults are the spec's: the app's short bench starts from them
    b.add_argument("--backends", "--backend", type=_csv(), default=list(d.backends),
                   help="local,mpi,torch: several in one run put their rows side by side")
    b.add_argument("--algorithms", type=_csv(), default=list(d.algorithms),
                   help=f"from {', '.join((*ALGORITHMS, 'auto'))} (native: the engine's "
                        "own all-reduce)")
    b.add_argument("--world-sizes", type=_csv(int), default=list(d.world_sizes),
                   help="ranks per run")
    b.add_argument("--sizes", type=_csv(_size), default=list(d.sizes),
                   help="bytes per buffer, with K, M or G for KiB, MiB, GiB (default: "
                        "4K,1M,16M,64M)")
    b.add_argument("--dtype", choices=["float32", "float64"], default=d.dtype,
                   help="buffer element type")
    b.add_argument("--warmup", type=int, default=d.warmup,
                   help="untimed calls per cell before timing")
    b.add_argument("--target-seconds", type=positive_float, default=d.target_seconds,
                   help="timed work per cell")
    b.add_argument("--reps", type=int, default=d.reps,
                   help="timed loops per cell, algorithms interleaved")
    b.add_argument("--worlds", type=positive_int, default=d.worlds,
                   help="worlds started one after another, every cell the median over all their "
                        "reps (where ranks outnumber cores, worlds differ)")
    b.add_argument("--max-iters", type=positive_int, default=d.max_iters,
                   help="most calls in one timed loop")
    _add_common_args(b,
                     "torch backend: gloo on CPU or NCCL with one GPU per rank (default: cpu, or "
                        "$DPLAB_DEVICE)")


def _add_memory(sub: Any) -> None:
    """Add ``dplab memory`` (run by ``memory.run_memory``), loading its module, the ZeRO formulas.

    Args:
        sub: the ``add_subparsers()`` of dplab's parser; so for ``_add_tune`` and ``_add_scaling``.
    """
    from dplab.backends.cli.memory import add_memory_parser

    add_memory_parser(sub, _Formatter)


def _add_tune(sub: Any) -> None:
    """Add ``dplab tune`` (run by ``tune.cmd_tune``), loading its module: the cost model's fit."""
    from dplab.backends.cli.tune import add_tune_parser

    add_tune_parser(sub, _Formatter)


def _add_scaling(sub: Any) -> None:
    """Add ``dplab scaling`` (run by ``scaling.cmd_scaling``), loading its module: the traces'
    metrics and DDP's bench."""
    from dplab.backends.cli.scaling import add_scaling_parser

    add_scaling_parser(sub, _Formatter)


# backends/' own commands, in the order ``dplab --help`` lists them: name -> what adds its parser
COMMANDS: dict[str, Callable[[Any], None]] = {
    "train": _add_train, "compare": _add_compare, "bench": _add_bench, "memory": _add_memory,
    "tune": _add_tune, "scaling": _add_scaling,
}
UPPER_COMMANDS = "dplab.commands"  # the entry-point group of the commands of viz/ and lessons/


class _Version(argparse.Action):
    """``--version``: the installed version, looked up only when asked for (argparse's own
    version action takes the text when the parser is built, and importlib.metadata is slow)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        """An option that takes no value.

        Args:
            option_strings: ``["--version"]``.
            dest: unused: the option stores nothing.
            **kwargs: ``help``, as argparse passes it.
        """
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        """Print ``dplab <version>`` on stdout and exit 0, as argparse's version action does.

        Args:
            parser: the parser that met ``--version``.
            *args: the namespace, values and option string argparse passes (unused).
        """
        print(f"dplab {dplab_version()}")
        parser.exit()


def upper_commands() -> dict[str, EntryPoint]:
    """The commands whose code lives above backends/, by name, as the installed dplab declares them.

    Returns:
        name -> its entry point of the group ``dplab.commands``; loaded, it is a function
        ``add(sub, formatter_class)`` that registers the command with ``run`` as its default.
    """
    from importlib.metadata import entry_points  # slow to import: only these commands pay for it

    return {ep.name: ep for ep in entry_points(group=UPPER_COMMANDS)}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """dplab's argument parser, with the options of ``command`` or of every command.

    Args:
        command: the command about to run: only its parser is built, and the modules of the others
            are not imported. None, or a word that names no command, builds every command's
            parser, so ``dplab --help`` lists them all and a mistyped command's error names them.

    Returns:
        The parser. What it parses has ``command``; a command from above backends/ adds ``run``,
        the function that runs it.
    """
    parser = _Parser(prog="dplab",
                     description="Data-Parallel Lab: data parallelism written by hand.",
                     formatter_class=_Formatter)
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if command in COMMANDS:
        COMMANDS[command](sub)
        return parser
    upper = upper_commands()
    if command in upper:
        upper[command].load()(sub, _Formatter)
        return parser
    for add in COMMANDS.values():
        add(sub)
    for entry in upper.values():
        entry.load()(sub, _Formatter)
    return parser
