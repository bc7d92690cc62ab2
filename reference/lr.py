"""Learning rates for large global batches: the scaling rules and linear warm-up.

For a global batch k times ``base_batch``: ``"linear"`` lr = base_lr * k, ``"sqrt"``
lr = base_lr * sqrt(k), ``"none"`` lr = base_lr (why each: reference/README.md, "Beyond replicas").

    >>> from dplab.reference.lr import scaled_lr, warmup_lr
    >>> scaled_lr(0.1, base_batch=256, global_batch=1024, rule="linear")
    0.4
    >>> scaled_lr(0.1, base_batch=256, global_batch=1024, rule="sqrt")
    0.2
    >>> [warmup_lr(1.0, warmup_steps=4, step=t) for t in (1, 2, 3, 4, 5)]
    [0.25, 0.5, 0.75, 1.0, 1.0]

``warmup_lr`` ramps linearly from lr / warmup_steps at update 1 to lr at update ``warmup_steps``;
the step is the optimizer's own count of updates, so every trainer and every resume gets it.
"""

from __future__ import annotations

import math

from dplab.reference.errors import ConfigError

__all__ = ["LR_RULES", "scaled_lr", "warmup_lr"]

LR_RULES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear") -> float:
    """The lr for ``global_batch`` when ``base_lr`` is right for ``base_batch`` (see the module).

    Args:
        base_lr: the learning rate tuned for ``base_batch``.
        base_batch: the batch it was tuned at.
        global_batch: the batch to train with.
        rule: "linear", "sqrt" or "none".

    Returns:
        The learning rate.

    Raises:
        ConfigError: an unknown rule, a batch < 1, or a negative or non-finite ``base_lr``.
    """
    if rule not in LR_RULES:
        raise ConfigError(f"lr rule must be one of {', '.join(LR_RULES)}, got {rule!r}")
    if not (base_batch >= 1 and global_batch >= 1):
        raise ConfigError(f"base_batch and global_batch must be >= 1, got {base_batch}, "
                          f"{global_batch}")
    if not (math.isfinite(base_lr) and base_lr >= 0):
        raise ConfigError(f"base_lr must be a finite number >= 0, got {base_lr}")
    k = global_batch / base_batch
    return base_lr * {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]


def warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The lr of update number ``step`` (1 for the first): ``lr * min(1, step / warmup_steps)``.

    ``warmup_steps=0`` returns ``lr`` itself (the same float, so runs without warm-up keep
    their bits).

    Args:
        lr: the learning rate after the warm-up.
        warmup_steps: updates the warm-up takes (0: none).
        step: the update's number, 1 for the first.

    Returns:
        The learning rate of that update.
    """
    if warmup_steps and step < warmup_steps:
        return lr * step / warmup_steps
    return lr
