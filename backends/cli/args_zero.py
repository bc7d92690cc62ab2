"""``dplab train``'s options for sharded data parallelism and mixed precision, and their configs.

    dplab train --zero-stage 3                          # ZeRO-3: weights, gradients, state sharded
    dplab train --mixed-precision fp16                  # fp16 compute, fp32 masters, loss scaling
    dplab train --zero-stage 2 --mixed-precision fp16 --reduce-dtype float16 --loss-scale 1024

Without ``--zero-stage`` the run is ``train_sync`` (replicas, bucketed all-reduce); with it, the
ZeRO trainer ``dplab.reference.zero.train`` (stage 0 is its replicated baseline). Mixed precision
keeps float32 master weights, so ``--dtype`` defaults to float32 under it.
"""

from __future__ import annotations

import argparse
import math

from dplab.reference.precision.config import SCALE_RANGE, MixedPrecision

__all__ = ["add_zero_args", "precision_config", "master_dtype", "precision_flags_error"]

PRECISION_ONLY = ("loss_scale", "reduce_dtype")  # mean something only under --mixed-precision


def _loss_scale(text: str) -> str | float:
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'dynamic' or a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError("a static loss scale must be finite and > 0, "
                                         f"got {text!r}")
    if not SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:
        raise argparse.ArgumentTypeError(f"a static loss scale must lie in float32's range "
                                         f"[{SCALE_RANGE[0]:.3g}, {SCALE_RANGE[1]:.3g}], "
                                         f"got {text!r}")
    return value


def add_zero_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharding and precision")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO: shard optimizer state (1), + gradients (2), + weights (3) "
                        "across the ranks; 0 = replicas through the same trainer; needs "
                        "--algorithm ring or direct for 1-3 and an element-wise optimizer "
                        "(default: none: plain data parallelism)")
    g.add_argument("--mixed-precision", choices=["no", "fp16"], default="no",
                   help="fp16: forward and backward on float16 copies of float32 master weights, "
                        "the loss scaled (default: no)")
    # None: not given; a value given without --mixed-precision is refused (precision_flags_error)
    g.add_argument("--loss-scale", type=_loss_scale, default=None, metavar="dynamic|S",
                   help="with --mixed-precision: 'dynamic' (skip the step and halve on "
                        "an overflow, double after 2000 good steps, as torch's GradScaler) or "
                        "a fixed S (default: dynamic)")
    g.add_argument("--reduce-dtype", choices=["float32", "float16"], default=None,
                   help="with --mixed-precision: the dtype gradients are reduced in "
                        "(default: float32)")


def precision_flags_error(a: argparse.Namespace) -> str | None:
    """Why the options contradict each other (``--loss-scale`` or ``--reduce-dtype`` without
    ``--mixed-precision``: they would be ignored), or None."""
    given = [f"--{k.replace('_', '-')}" for k in PRECISION_ONLY if getattr(a, k, None) is not None]
    if given and getattr(a, "mixed_precision", "no") == "no":
        return (f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to mixed "
                "precision: add --mixed-precision fp16, or drop it")
    return None


def precision_config(a: argparse.Namespace) -> MixedPrecision | None:
    """The ``MixedPrecision`` the options ask for, or None."""
    if getattr(a, "mixed_precision", "no") == "no":  # compare has no such option
        return None
    return MixedPrecision(compute_dtype="float16", reduce_dtype=a.reduce_dtype or "float32",
                          loss_scale="dynamic" if a.loss_scale is None else a.loss_scale)


def master_dtype(a: argparse.Namespace) -> str:
    """``--dtype``, or its default: float32 masters under mixed precision, float64 otherwise."""
    if a.dtype is not None:
        return a.dtype
    return "float64" if precision_config(a) is None else "float32"
