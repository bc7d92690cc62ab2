"""``dplab memory``: model-state memory per rank under ZeRO stages 0-3, for a model of any size.

    dplab memory                                     # 7B, Adam, mixed precision, N = 1, 8, 64
    dplab memory --params 7.5B --world-sizes 64      # ZeRO paper's Figure 1: 120/31.4/16.6/1.9 GB
    dplab memory --params 350M --optimizer sgd --precision float32 --stages 0,3 --json mem.json

Nothing runs: the numbers come from ``dplab.reference.zero.memory``, the same closed forms that
the ZeRO trainer's tests check against the bytes it really holds. Bad input is one line on
stderr and exit code 2, as in the other subcommands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
from decimal import Decimal, InvalidOperation
from typing import Any

from dplab.backends.cli.args_optim import csv_list
from dplab.backends.cli.checks import check_output_file
from dplab.backends.cli.table import format_table
from dplab.reference.errors import ConfigError
from dplab.reference.files import WriteError, write_atomic
from dplab.reference.zero.memory import (
    GB,
    OPTIMIZER_STATES,
    PRECISIONS,
    STAGES,
    model_state_bytes,
    precision_bytes,
    state_bytes_per_param,
)

__all__ = ["add_memory_parser", "parse_params", "memory_rows", "memory_header", "run_memory",
           "MEMORY_COLUMNS", "MEMORY_EPILOG"]

MEMORY_COLUMNS = ["stage", "world_size", "params_gb", "grads_gb", "optimizer_gb", "total_gb",
                  "reduction"]
MAX_PARAMS = 10**15  # some 500 times the largest models trained so far: a typo, not a model
# counts, not bytes: decimal
SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
MEMORY_EPILOG = """\
columns (per rank, GB = 1e9 bytes, model states only: activations and buffers come on top):
  params_gb     weights: P bytes x Psi, sharded (/ N) at stage 3
  grads_gb      gradients: G bytes x Psi, sharded at stages 2 and 3
  optimizer_gb  optimizer state, the fp32 master copy included: K bytes x Psi, sharded at stages 1-3
  total_gb      their sum: (P + G + K) Psi, (P + G + K/N) Psi, (P + (G + K)/N) Psi, \
(P + G + K) Psi / N
  reduction     stage 0's total / this total at the same N (ZeRO's 4x, 8x, Nx as N grows)
"""


def parse_params(text: str) -> int:
    """A parameter count: ``7B``, ``350M``, ``1.3e9``, ``125K``, ``1.5T`` or digits (decimal units).

    Decimal arithmetic, so ``1.3B`` is exactly 1,300,000,000; a count that is not whole is refused.

    Args:
        text: the count as typed.

    Returns:
        The number of parameters.

    Raises:
        argparse.ArgumentTypeError: not a number, not whole, below 1 or over 1e15.
    """
    s = text.strip().upper().replace("_", "").replace(",", "")
    unit = s[-1] if s and s[-1] in SUFFIXES and s[-1] != "E" else ""
    try:
        value = Decimal(s[: len(s) - len(unit)]) * SUFFIXES[unit]
    except (InvalidOperation, ValueError):
        raise argparse.ArgumentTypeError(f"invalid parameter count {text!r}: a number, "
                                         "optionally with K, M, B or T (7B, 350M, 1.3e9)") from None
    if not value.is_finite() or value < 1 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError("parameter count must be a whole number >= 1, "
                                         f"got {text!r}")
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"parameter count {text!r} is over 1e15: give at "
                                         "most 1000T")
    return int(value)


def _int_list(allowed: tuple[int, ...] | None, what: str):
    """A comma-separated list of integers >= 1 (or among ``allowed``),
    duplicates dropped, order kept."""
    def parse(text: str) -> list[int]:
        values = csv_list(int, what=what)(text)
        bad = [v for v in values if (v not in allowed if allowed else v < 1)]
        if bad:
            need = f"one of {', '.join(map(str, allowed))}" if allowed else "an integer >= 1"
            raise argparse.ArgumentTypeError(f"{what} {bad[0]}: must be {need}")
        return list(dict.fromkeys(values))
    return parse


def add_memory_parser(sub: Any,
                      formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register ``dplab memory`` on the subparsers ``sub`` (args.py passes its formatter: one
    style).

    Args:
        sub: the subparsers of ``dplab``.
        formatter_class: the help formatter every command uses.

    Returns:
        The ``memory`` parser.
    """
    m = sub.add_parser("memory", help="memory per rank of ZeRO stages 0-3 for a model of any size",
                       formatter_class=formatter_class, epilog=MEMORY_EPILOG,
                       description=textwrap.fill(
                           "Per-rank memory of weights, gradients and optimizer state under "
                           "ZeRO stages 0-3 (Rajbhandari et al. 2020) for a model of any "
                           "size, precision and world size, from the closed forms the ZeRO "
                           "trainer's tests check. Nothing runs.", 88))
    m.add_argument("--params", type=parse_params, default="7B", metavar="COUNT",
                   help="parameters (Psi): 7B, 350M, 1.3e9, 125K, 1.5T or digits; decimal units")
    m.add_argument("--optimizer", choices=list(OPTIMIZER_STATES), default="adam",
                   help="optimizer state buffers per parameter: sgd 0, momentum and lars 1, "
                        "adam and lamb 2")
    m.add_argument("--precision", choices=list(PRECISIONS), default="mixed",
                   help="float64/float32: everything in that type; mixed (fp16) and "
                        "bf16-mixed: 2-byte weights and gradients, a 4-byte master copy and 4-byte "
                        "optimizer state")
    m.add_argument("--world-sizes", type=_int_list(None, "world size"), default=[1, 8, 64],
                   metavar="N,...", help="ranks N to shard over, comma-separated")
    m.add_argument("--stages", type=_int_list(STAGES, "stage"), default=list(STAGES),
                   metavar="S,...",
                   help="ZeRO stages: 0 replicates everything, 1 shards the optimizer state, "
                        "2 also the gradients, 3 also the weights")
    m.add_argument("--json", metavar="PATH",
                   help="also write the rows, in bytes and GB with full precision, as JSON "
                        "(default: not written)")
    return m


def memory_rows(num_params: int, optimizer: str, precision: str, stages: list[int],
                world_sizes: list[int]) -> list[dict[str, Any]]:
    """One row per world size x stage (stages inner: each N's stages read down the table).

    Args:
        num_params: the model's parameters.
        optimizer: ``sgd``, ``momentum``, ``adam``, ``lars`` or ``lamb`` (its state per parameter).
        precision: ``float64``, ``float32``, ``mixed`` or ``bf16-mixed``.
        stages: ZeRO stages, 0-3.
        world_sizes: the N to shard over.

    Returns:
        Rows ``{stage, world_size, params_gb, grads_gb, optimizer_gb, total_gb, reduction}``, in
        GB of 1e9 bytes per rank.

    Raises:
        ConfigError: an unknown optimizer or precision.
    """
    p = precision_bytes(precision)
    k = state_bytes_per_param(optimizer, precision)
    bytes_ = {"param_bytes": p.param_bytes, "grad_bytes": p.grad_bytes, "state_bytes": k}
    rows = []
    for n in world_sizes:
        base = model_state_bytes(num_params, 0, n, **bytes_).total
        for stage in stages:
            b = model_state_bytes(num_params, stage, n, **bytes_)
            rows.append({
                "num_params": num_params, "optimizer": optimizer, "precision": precision, **bytes_,
                "stage": stage, "world_size": n, "params_bytes": b.params, "grads_bytes": b.grads,
                "optimizer_bytes": b.optimizer, "total_bytes": b.total, "params_gb": b.params / GB,
                "grads_gb": b.grads / GB, "optimizer_gb": b.optimizer / GB,
                "total_gb": b.total / GB, "reduction": base / b.total,
            })
    return rows


def memory_header(num_params: int, optimizer: str, precision: str) -> str:
    """The lines above the table: what one parameter costs, where K comes from, what GB means.

    Args:
        num_params: the model's parameters.
        optimizer: the optimizer's name.
        precision: the precision's name.

    Returns:
        Two lines of text.
    """
    p = precision_bytes(precision)
    k = state_bytes_per_param(optimizer, precision)
    buffers = OPTIMIZER_STATES[optimizer]
    parts = ([f"{p.master_bytes} master copy"] if p.master_bytes else []) + (
        [f"{buffers} x {p.moment_bytes} {optimizer} state"] if buffers else [])
    return (f"{num_params:,} parameters, {optimizer}, {precision}: {p.param_bytes} + "
            f"{p.grad_bytes} + {k} = {p.param_bytes + p.grad_bytes + k} bytes per parameter "
            "(weights + gradients + optimizer state "
            f"K{' = ' + ' + '.join(parts) if parts else ''})\nper rank, GB = 1e9 bytes, model "
            "states only: activations and buffers come on top")


def run_memory(a: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Print the table (and write ``--json``); a bad ``--json`` path is one line and exit code 2.

    Args:
        a: the parsed ``dplab memory`` arguments.
        argv: the command line, recorded in the JSON's meta (None: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, or 2 for a bad path.
    """
    try:
        if a.json:
            check_output_file("--json", a.json)
        rows = memory_rows(a.params, a.optimizer, a.precision, a.stages, a.world_sizes)
    except ConfigError as e:
        print(f"dplab memory: error: {e}", file=sys.stderr)
        return 2
    try:
        print(memory_header(a.params, a.optimizer, a.precision))
        print(format_table(rows, MEMORY_COLUMNS), flush=True)
    # `dplab memory | head -2`: the reader left; end quietly, still write --json
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if a.json:
        meta = {"command": "memory", "argv": sys.argv[1:] if argv is None else argv,
                "python": platform.python_version(), "machine": platform.machine()}
        try:
            text = json.dumps({"meta": meta, "rows": rows}, indent=1)
            write_atomic(a.json, text.encode(), "--json")
        except WriteError as e:
            print(f"dplab memory: error: {e}", file=sys.stderr)
            return 2
        print(f"rows written to {a.json}")
    return 0
