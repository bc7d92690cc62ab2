"""``dplab tune``: fit alpha, beta, gamma per backend to a short bench and save them for ``auto``.

    dplab tune                                           # local, world sizes 2,4: bench, fit, save
    dplab tune --backends local,mpi,torch --world-sizes 2,4 --sizes 4K,64K,1M,16M
    dplab tune --from-json bench.json --out tune.json    # fit rows `dplab bench --json` wrote
    DPLAB_TUNE=tune.json dplab bench --algorithms auto,ring,native

The bench is ``dplab bench`` itself (its parser, checks and runner, handed in by ``commands``),
every registered all-reduce and ``native``. The fit is ``dplab.reference.costfit``: least squares
on relative error, per backend, per backend and world size, and per backend, world size and
algorithm; all three are saved and ``algorithm="auto"`` prices each candidate with the most
specific one that covers it (``dplab.reference.auto``). The table shows how much each finer fit
gains (its residuals). The fit goes to ``--out``, by default ``$DPLAB_TUNE`` or
``~/.cache/dplab/tune.json``: where auto looks.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dplab.backends.bench.timing import parse_size
from dplab.backends.cli.args_optim import csv_list
from dplab.backends.cli.checks import check_output_file
from dplab.backends.runs import uploads
from dplab.reference import auto, costfit
from dplab.reference.algorithms import ALLREDUCE
from dplab.reference.errors import ConfigError
from dplab.reference.files import read_regular

__all__ = ["add_tune_parser", "cmd_tune", "tune_fits", "bench_rows", "TUNE_COLUMNS", "LEVELS"]

TUNE_COLUMNS = ["backend", "world_size", "algorithm", "rows", "alpha_us", "beta_gbps", "gamma_gbps",
                "rms_residual_pct", "max_residual_pct"]
LEVELS = (("backend",), ("backend", "world_size"), ("backend", "world_size", "algorithm"))
Bench = Callable[[list[str]], list[dict[str, Any]]]  # `dplab bench ARGV` -> its rows
TUNE_EPILOG = """\
columns:
  world_size, algorithm  "all": one fit over every world size / every schedule of ours
  alpha_us      latency per message; beta_gbps: 1 / beta, bytes per second on the critical path
  gamma_gbps    1 / gamma, reduced bytes per second ("-": folded into beta, the schedules could not
                tell them apart; per-algorithm fits always fold it)
  *_residual_pct  (measured - fitted) / measured over the fit's rows: rms and worst
"""


def add_tune_parser(sub: Any,
                    formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register ``dplab tune`` on the subparsers ``sub`` (args.py
    passes its formatter: one style)."""
    t = sub.add_parser("tune",
                       help="fit alpha, beta, gamma per backend and save them for --algorithm auto",
                       formatter_class=formatter_class, epilog=TUNE_EPILOG,
                       description=textwrap.fill(
                           "Run a short dplab bench of every registered all-reduce and native "
                           "(or read one with --from-json), fit the alpha-beta-gamma cost model "
                           "to it by least squares, print the fit with its residuals and save "
                           "it where algorithm='auto' reads it.", 88))
    t.add_argument("--backends", "--backend", type=csv_list(str, what="backend"), default=["local"],
                   help="local,mpi,torch")
    t.add_argument("--world-sizes", type=csv_list(int, what="world size"), default=[2, 4],
                   help="ranks per run")
    t.add_argument("--sizes", type=csv_list(parse_size, what="size"),
                   default=[4096, 1 << 16, 1 << 20, 16 << 20],
                   help="bytes per buffer, with K, M or G (default: 4K,64K,1M,16M)")
    t.add_argument("--algorithms", type=csv_list(str, what="algorithm"), default=None,
                   help="what to bench (default: every registered all-reduce and native)")
    t.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="buffer element type")
    t.add_argument("--reps", type=int, default=3,
                   help="timed loops per cell, algorithms interleaved")
    t.add_argument("--target-seconds", type=float, default=0.1, help="timed work per cell")
    t.add_argument("--from-json", metavar="PATH", default=None,
                   help="fit these `dplab bench --json` rows instead of running a bench")
    t.add_argument("--out", metavar="PATH", default=None,
                   help=f"where to save the fit (default: ${auto.TUNE_ENV}, else "
                        f"{auto.DEFAULT_TUNE_PATH})")
    t.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="torch backend: gloo on CPU or NCCL (its fit is saved as torch-nccl)")
    t.add_argument("--json", metavar="PATH",
                   help="also write the rows as JSON (default: not written)")
    return t


def bench_rows(a: argparse.Namespace, bench: Bench) -> list[dict[str, Any]]:
    """``--from-json``'s rows, or a short bench run now: ``bench(argv)`` is ``dplab bench argv``
    (the command line passes its own parser, checks and runner, so tune times what bench times)."""
    if a.from_json:  # a regular file within the uploads' size bound, or one line (a FIFO: not read)
        text = read_regular(a.from_json, uploads.BENCH.max_bytes, "--from-json")
        rows = uploads.bench_rows(text, a.from_json)  # checked whole: sizes, types, ranges
    else:
        algorithms = a.algorithms or [*ALLREDUCE, "native"]
        argv = ["--backends", ",".join(a.backends),
                "--world-sizes", ",".join(map(str, a.world_sizes)), "--sizes",
                ",".join(map(str, a.sizes)), "--algorithms", ",".join(algorithms),
                "--dtype", a.dtype, "--reps", str(a.reps), "--target-seconds",
                str(a.target_seconds)]
        rows = bench(argv + (["--device", a.device] if a.device else []))
    if a.device == "cuda":
        rows = [dict(r, backend="torch-nccl") if r["backend"] == "torch" else r for r in rows]
    return rows


def tune_fits(rows: list[dict[str, Any]], itemsize: int = 4) -> list[costfit.CostFit]:
    """The fits of every level (``LEVELS``), coarsest first; native's per-world-size fits once."""
    fits: dict[tuple[str, str, str], costfit.CostFit] = {}
    for by in LEVELS:
        for f in costfit.fit(rows, by, itemsize):
            fits.setdefault((f.backend, str(f.world_size), f.algorithm), f)
    return list(fits.values())


def _gains(fits: list[costfit.CostFit], itemsize: int) -> list[str]:
    """Per backend, one line: the rms residual of each level, so the
    reader sees what finer fits buy."""
    lines = []
    for backend in sorted({f.backend for f in fits}):
        parts = []
        for by, label in zip(LEVELS,
                             ("per backend", "per world size", "per algorithm and world size")):
            res = [r["residual_pct"] for f in fits if f.backend == backend
                   and f.algorithm != "native"
                   and (f.world_size != "all") == ("world_size" in by)
                   and (f.algorithm != "all") == ("algorithm" in by)
                   for r in f.residuals(itemsize) if r["residual_pct"] is not None]
            if res:
                parts.append(f"{float(np.sqrt(np.mean(np.square(res)))):.3g}% {label}")
        if parts:
            lines.append(f"{backend}: rms residual of our schedules " + ", ".join(parts)
                         + " (auto prices each candidate with the finest fit that has it)")
    return lines


def cmd_tune(a: argparse.Namespace, bench: Bench) -> list[dict[str, Any]]:
    """Bench with ``bench`` (or read), fit every level, save where auto
    reads, return one row per fit."""
    out = Path(a.out).expanduser() if a.out else auto.tune_path()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create {out.parent} ({e.strerror}): "
                          "choose another path") from None
    check_output_file("--out", str(out))
    itemsize = np.dtype(a.dtype).itemsize
    rows = bench_rows(a, bench)
    fits = tune_fits(rows, itemsize)
    if not fits:
        raise ConfigError("no row to fit: tune needs rows of our schedules or native at world "
                          "size >= 2")
    auto.save_tuning(auto.Tuning(tuple(fits), str(out)), out)
    auto.reset()
    for line in _gains(fits, itemsize):
        print(line, flush=True)
    print(f"fit saved to {out}" + ("" if out == auto.tune_path() else
                                   f"; auto reads it with {auto.TUNE_ENV}={out}"), flush=True)
    return [f.summary(itemsize) for f in fits]
