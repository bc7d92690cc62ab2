"""The memory of model states per rank under ZeRO stages 0-3: the closed forms, one source of truth.

    >>> from dplab.reference.zero.memory import model_state_bytes, state_bytes_per_param
    >>> k = state_bytes_per_param("adam", "mixed")          # fp32 master + m + v = 4 + 4 + 4
    >>> b = model_state_bytes(7.5e9, stage=1, world_size=64, state_bytes=k)
    >>> k, round(b.total / 1e9, 1)
    (12, 31.4)

or ``dplab memory --params 7B --world-sizes 1,8,64``. Psi parameters, N ranks, per parameter P
bytes of weights, G of gradient, K of optimizer state (mixed-precision Adam: 2, 2, 12); the
paper's Figure 1 (Rajbhandari et al. 2020), Psi = 7.5e9, N = 64, GB = 1e9 bytes, model states only:

    stage 0   (P + G + K) Psi:  16 x 7.5e9            = 120   GB per rank
    stage 1   (P + G) Psi + K Psi / N:  (4 + 12/64) x 7.5e9  =  31.4 GB
    stage 2   P Psi + (G + K) Psi / N:  (2 + 14/64) x 7.5e9  =  16.6 GB
    stage 3   (P + G + K) Psi / N:  16 x 7.5e9 / 64   =   1.9 GB
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from dplab.reference.errors import ConfigError

__all__ = ["MemoryBreakdown", "PrecisionBytes", "PRECISIONS", "OPTIMIZER_STATES", "STAGES",
           "model_state_bytes", "state_bytes_per_param", "precision_bytes", "GB"]

GB = 1e9  # the paper's (and GPU vendors') gigabyte; GiB would make Figure 1's 120 GB read 111.8
STAGES = (0, 1, 2, 3)

# Optimizer state buffers per parameter, besides the weights: momentum keeps one (the velocity),
# Adam two (first and second moments). LARS is momentum with a per-layer trust ratio, LAMB is
# Adam with one: a scalar per layer, nothing per parameter.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "lars": 1, "lamb": 2}


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter of each model state under one precision recipe.

    ``master_bytes`` is the full-precision copy that mixed precision updates (fp16 weights cannot
    hold a small update: 1 + 1e-4 rounds to 1); it counts as optimizer state, as in the paper,
    because only the optimizer step reads it, so ZeRO-1 shards it with the moments.
    ``moment_bytes`` is one optimizer state buffer (momentum, Adam's m or v).

    Args:
        param_bytes: bytes per weight.
        grad_bytes: bytes per gradient element.
        master_bytes: bytes of the full-precision copy (0 without one).
        moment_bytes: bytes of one optimizer state buffer.
    """

    param_bytes: int
    grad_bytes: int
    master_bytes: int
    moment_bytes: int


PRECISIONS = {
    "float64": PrecisionBytes(8, 8, 0, 8),
    "float32": PrecisionBytes(4, 4, 0, 4),
    "mixed": PrecisionBytes(2, 2, 4, 4),  # fp16 weights and gradients, fp32 master and moments
    "bf16-mixed": PrecisionBytes(2, 2, 4, 4),  # bf16 likewise; no loss scaling needed, same bytes
}


def precision_bytes(precision: str) -> PrecisionBytes:
    """The bytes of ``precision`` ("float64", "float32", "mixed", "bf16-mixed").

    Args:
        precision: one of ``PRECISIONS``.

    Returns:
        Bytes of a weight, a gradient, a master copy and a moment.

    Raises:
        ConfigError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def state_bytes_per_param(optimizer: str, precision: str) -> int:
    """K: optimizer-state bytes per parameter, the master copy included
    (Adam mixed: 4 + 4 + 4 = 12).

    Args:
        optimizer: one of ``OPTIMIZER_STATES`` ("sgd", "momentum", "adam", ...).
        precision: one of ``PRECISIONS``.

    Returns:
        Bytes per parameter.

    Raises:
        ConfigError: an unknown optimizer or precision.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got "
                          f"{optimizer!r}")
    p = precision_bytes(precision)
    return p.master_bytes + OPTIMIZER_STATES[optimizer] * p.moment_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of model states one rank holds (floats: Psi / N need not be whole).

    Args:
        params: bytes of weights.
        grads: bytes of gradients.
        optimizer: bytes of optimizer state (masters included).
    """

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(num_params: float, stage: int, world_size: int, *, param_bytes: float = 2,
                      grad_bytes: float = 2, state_bytes: float = 12) -> MemoryBreakdown:
    """Per-rank bytes of weights, gradients and optimizer state at ZeRO ``stage`` on ``world_size``
    ranks.

    Stage s shards the first s of (optimizer state, gradients, weights) over the ranks and
    replicates the rest; the defaults are the paper's mixed-precision Adam (2, 2, 12).

    Args:
        num_params: the model's parameter count.
        stage: the ZeRO stage, 0 to 3.
        world_size: the number of ranks.
        param_bytes: bytes per weight.
        grad_bytes: bytes per gradient element.
        state_bytes: optimizer-state bytes per parameter (``state_bytes_per_param``).

    Returns:
        Bytes per rank of weights, gradients and optimizer state.

    Raises:
        ConfigError: a bad stage or world_size, or a count that is not a finite number >= 0.
    """
    if isinstance(stage, bool) or stage not in STAGES:
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, numbers.Integral)
        or world_size < 1
    ):
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    named = {"num_params": num_params, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
             "state_bytes": state_bytes}
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    n = world_size
    return MemoryBreakdown(
        params=num_params * param_bytes / (n if stage >= 3 else 1),
        grads=num_params * grad_bytes / (n if stage >= 2 else 1),
        optimizer=num_params * state_bytes / (n if stage >= 1 else 1),
    )
