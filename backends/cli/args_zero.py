"""``dplab train``'s options for sharded data parallelism and mixed precision, and their configs.

    dplab train --zero-stage 3                          # ZeRO-3: weights, gradients, state sharded
    dplab train --mixed-precision fp16                  # float16 compute, float32 masters, loss scaling
    dplab train --zero-stage 2 --mixed-precision fp16 --reduce-dtype float16 --loss-scale 1024

Without ``--zero-stage`` the run is ``train_sync`` (replicas, bucketed all-reduce); with it, the
ZeRO trainer ``dplab.reference.zero.train`` (stage 0 is its replicated baseline). Mixed precision
keeps float32 master weights, so ``--dtype`` defaults to float32 under it.
"""

from __future__ import annotations

import argparse
import math

from dplab.reference.precision.config import MixedPrecision

__all__ = ["add_zero_args", "precision_config", "master_dtype"]


def _loss_scale(text: str) -> str | float:
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'dynamic' or a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"a static loss scale must be finite and > 0, got {text!r}")
    return value


def add_zero_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharding and precision")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="ZeRO: shard optimizer state (1), + gradients (2), + weights (3) across the "
                        "ranks; 0 = replicas through the same trainer; needs --algorithm ring or "
                        "direct for 1-3 and an element-wise optimizer (default: none, train_sync)")
    g.add_argument("--mixed-precision", choices=["no", "fp16"], default="no",
                   help="fp16: forward and backward on float16 copies of float32 master weights, "
                        "the loss scaled (default: no)")
    g.add_argument("--loss-scale", type=_loss_scale, default="dynamic", metavar="dynamic|S",
                   help="with --mixed-precision: 'dynamic' (skip the step and halve on an overflow, "
                        "double after 2000 good steps, as torch's GradScaler) or a fixed S "
                        "(default: dynamic)")
    g.add_argument("--reduce-dtype", choices=["float32", "float16"], default="float32",
                   help="with --mixed-precision: the dtype gradients are reduced in (default: float32)")


def precision_config(a: argparse.Namespace) -> MixedPrecision | None:
    """The ``MixedPrecision`` the options ask for, or None."""
    if getattr(a, "mixed_precision", "no") == "no":  # compare has no such option
        return None
    return MixedPrecision(compute_dtype="float16", reduce_dtype=a.reduce_dtype, loss_scale=a.loss_scale)


def master_dtype(a: argparse.Namespace) -> str:
    """``--dtype``, or its default: float32 masters under mixed precision, float64 otherwise."""
    if a.dtype is not None:
        return a.dtype
    return "float64" if precision_config(a) is None else "float32"
