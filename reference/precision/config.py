"""How a run uses half precision: the compute dtype, the reduction dtype, the loss scale.

    from dplab.reference.precision import MixedPrecision
    MixedPrecision()                               # float16 compute, float32 reduce, dynamic scale
    MixedPrecision(reduce_dtype="float16", loss_scale=1024.0)  # static scale, float16 all-reduce
    SyncConfig(precision=MixedPrecision())         # with TrainConfig(dtype="float32"): the masters

The scaler's knobs and defaults are torch.amp.GradScaler's (init_scale 2**16, growth 2, backoff
0.5, growth_interval 2000). Master weights are float32, as in torch AMP: with float64 masters
the run would measure something no one trains with, so ``validate`` refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError

__all__ = ["MixedPrecision", "SCALE_RANGE"]

_COMPUTE = ("float16",)  # numpy has no bfloat16: the reference trainer computes in float16
_REDUCE = ("float16", "float32")
# S lives in a float32 (as torch's GradScaler keeps it) and gradients are divided by it there:
# outside float32's normal range it would round to inf or to 0, and every unscaled gradient to
# 0 or inf
SCALE_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


@dataclass(frozen=True)
class MixedPrecision:
    """float16 compute copies of float32 master weights, gradients reduced in ``reduce_dtype``.

    ``loss_scale`` is a number (static: never changes; an overflow stops the run with an error
    before the step, which would put inf or nan into every weight) or ``"dynamic"`` (torch's
    GradScaler: skip the step and multiply the scale by ``backoff_factor`` on an overflow, by
    ``growth_factor`` after ``growth_interval`` steps without one). Scales lie in float32's normal
    range, ``SCALE_RANGE``.

    Args:
        compute_dtype: "float16".
        reduce_dtype: "float32" or "float16".
        loss_scale: a number (static) or "dynamic".
        init_scale: the dynamic scale's start.
        growth_factor: the dynamic scale's growth (> 1).
        backoff_factor: the dynamic scale's backoff (in (0, 1)).
        growth_interval: good steps between growths.
    """

    compute_dtype: str = "float16"
    reduce_dtype: str = "float32"  # float16: half the bytes on the wire, p-1 more roundings
    loss_scale: float | str = "dynamic"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"

    def validate(self, master_dtype: DTypeLike | None = None) -> None:
        """Raise ``ConfigError`` naming the field to change; ``master_dtype``:
        the run's parameters.

        Args:
            master_dtype: the run's parameter dtype, if known (must be float32).

        Raises:
            ConfigError: a bad dtype, loss scale or scaler setting, or masters that are not float32.
        """
        if self.compute_dtype not in _COMPUTE:
            raise ConfigError(f"compute_dtype must be 'float16', not {self.compute_dtype!r} (numpy "
                              "has no bfloat16; for bfloat16 use torch tensors on the torch "
                              "backend)")
        if self.reduce_dtype not in _REDUCE:
            raise ConfigError("reduce_dtype must be 'float16' or 'float32', not "
                              f"{self.reduce_dtype!r}")
        if isinstance(self.loss_scale, str):
            if self.loss_scale != "dynamic":
                raise ConfigError("loss_scale must be a number > 0 or 'dynamic', not "
                                  f"{self.loss_scale!r}")
        elif not _scale(self.loss_scale):
            raise ConfigError(f"a static loss_scale must be a number in [{SCALE_RANGE[0]:.3g}, "
                              f"{SCALE_RANGE[1]:.3g}] (float32's), got {self.loss_scale!r}")
        if not _scale(self.init_scale):
            raise ConfigError(f"init_scale must be a number in [{SCALE_RANGE[0]:.3g}, "
                              f"{SCALE_RANGE[1]:.3g}] (float32's), got {self.init_scale!r}")
        if not (_positive(self.growth_factor) and self.growth_factor > 1):
            raise ConfigError("growth_factor must be > 1 (as in GradScaler), got "
                              f"{self.growth_factor!r}")
        if not (_positive(self.backoff_factor) and self.backoff_factor < 1):
            raise ConfigError(f"backoff_factor must lie in (0, 1), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ConfigError("growth_interval must be an integer >= 1, got "
                              f"{self.growth_interval!r}")
        if master_dtype is not None and np.dtype(master_dtype) != np.float32:
            raise ConfigError("mixed precision keeps float32 master weights, got "
                              f"{np.dtype(master_dtype)}: set TrainConfig(dtype='float32') (dplab "
                              "train: --dtype float32, its default here)")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _scale(x: object) -> bool:
    return _positive(x) and SCALE_RANGE[0] <= x <= SCALE_RANGE[1]  # type: ignore[operator]
