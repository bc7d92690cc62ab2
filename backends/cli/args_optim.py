"""Options of the optimizer (train and compare) and of the large-batch sweep (compare), and the
number and list parsers every command's options share (``positive_int``, ``csv_list``).

    dplab train --optimizer lamb --lr 0.005 --warmup-steps 10
    dplab compare --global-batches 64,256,1024,4096 --lr-rule linear,sqrt \\
        --optimizer momentum --lr 0.05

The sweep's options default to None ("not given") so that giving one without
``--global-batches`` is an error rather than silently nothing; the sweep fills in its defaults
(``sweep.py``). Its data set defaults differ from compare's: the sweep is about classification
on a data set larger than its largest batch, so ``--dataset`` and ``--num-samples`` carry a
marked default that the sweep can tell from the same value typed by the user (``is_default``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from dplab.reference.lr import LR_RULES
from dplab.reference.optim import OPTIMIZERS, OptimConfig

__all__ = ["add_optimizer_args", "add_sweep_args", "optim_config", "is_default", "SWEEP_DATA",
           "positive_int", "positive_float"]

SWEEP_DATA = {"dataset": "classification", "num_samples": 8192}  # unless given


class _DefaultStr(str):
    """The parser's default, not the user's: equal to it, and recognisable (``is_default``)."""


class _DefaultInt(int):
    """As ``_DefaultStr``, for numbers."""


def is_default(value: Any) -> bool:
    """Whether ``value`` is a marked default (the option was not given)."""
    return isinstance(value, (_DefaultStr, _DefaultInt))


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0: NaN compares false with everything, so it slips
    past a plain ``<= 0``."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: give integers, "
                                         "e.g. 64,256,1024") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: give integers >= 1, e.g. 64,256,1024")
    return values


def _rules(text: str) -> list[str]:
    rules = [v.strip() for v in text.split(",") if v.strip()]
    bad = [r for r in rules if r not in LR_RULES]
    if not rules or bad:
        raise argparse.ArgumentTypeError(f"bad lr rule list {text!r}: use {', '.join(LR_RULES)}")
    return list(dict.fromkeys(rules))


def add_optimizer_args(g: argparse._ArgumentGroup) -> None:
    """``--optimizer``, ``--lr`` and what LARS, LAMB and a warm-up need (train and compare)."""
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="optimizer; lars and lamb keep one trust ratio per weight and bias tensor")
    g.add_argument("--lr", type=positive_float, default=0.01,
                   help="learning rate (dplab compare's --global-batches sweep: the lr at its "
                        "--base-batch); lars moves each tensor by about lr x --trust-coef of "
                        "its norm, so it wants lr ~ 1-10")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=0,
                   help="ramp the lr linearly over the first N updates (0: none)")
    g.add_argument("--trust-coef", type=positive_float, default=OptimConfig().trust_coef,
                   help="lars: the trust coefficient eta of You et al.")
    g.add_argument("--weight-decay", type=_nonneg_float, default=0.0,
                   help="L2 added to the gradient (sgd, momentum, adam); lars and lamb as "
                        "their papers")


def optim_config(a: argparse.Namespace) -> OptimConfig:
    """The ``OptimConfig`` the parsed options describe."""
    return OptimConfig(a.optimizer, a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
                       trust_coef=a.trust_coef)


def add_sweep_args(c: argparse.ArgumentParser) -> None:
    """The large-batch sweep of ``dplab compare`` (``sweep.py``), and its data set defaults."""
    g = c.add_argument_group("large-batch sweep (rows per global batch x lr rule)")
    g.add_argument("--global-batches", type=_positive_ints, default=None,
                   help="sweep these global batches, e.g. 64,256,1024,4096 (default: no "
                        "sweep). Every cell sees the same samples, --steps x the largest "
                        "batch: the largest batch takes --steps steps, a batch k times smaller "
                        "k times as many")
    g.add_argument("--lr-rule", type=_rules, default=None,
                   help=f"how the lr grows with the batch: {', '.join(LR_RULES)}, or several, "
                        "e.g. linear,sqrt (default: linear)")
    g.add_argument("--base-batch", type=positive_int, default=None,
                   help="the global batch at which --lr is right (default: 64)")
    g.add_argument("--at-steps", type=_positive_ints, default=None,
                   help="report the loss after these steps (default: --steps / 5 and --steps)")
    g.add_argument("--at-samples", type=_positive_ints, default=None,
                   help="report the loss once this many samples are seen (default: the largest "
                        "batch x --at-steps)")
    for action in c._actions:  # the sweep's data set, unless given: see the module docstring
        key = action.dest
        if key in SWEEP_DATA:
            action.default = (_DefaultStr
                              if isinstance(action.default, str) else _DefaultInt)(action.default)
            action.help += (
                f" (default: {action.default}; a --global-batches sweep: {SWEEP_DATA[key]})"
            )


def csv_list(kind: Any = str, empty_ok: bool = False, what: str = "value"):
    """A comma-separated list of at least one value: an empty grid would run nothing and say so
    late. Every command's list options parse through this one function."""
    def parse(text: str) -> list:
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None
        if not values and not empty_ok:
            raise argparse.ArgumentTypeError(f"empty list {text!r}: give at least one {what}")
        return values
    return parse
