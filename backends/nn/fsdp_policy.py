"""FSDP's mixed-precision policy per unit, as torch's ``MixedPrecision``, with norms kept in
float32.

    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    FSDP(model, comm, units=list(model.blocks), mixed_precision=mp, keep_float32=(nn.LayerNorm,))
    FSDP(model, comm, units=[a, b], mixed_precision={a: mp})   # per unit: b and the root stay fp32

A policy gives one unit the dtype its parameters are gathered and computed in (``param_dtype``),
its gradients reduce-scattered in (``reduce_dtype``) and its floating buffers cast to per forward
(``buffer_dtype``); ``None`` is the master dtype, no cast. Units missing from a mapping run in full
precision; each unit casts its floating inputs to its ``param_dtype``, so units of different dtypes
chain. ``keep_float32`` modules keep parameters and buffers in the master dtype (a separate flat of
the same unit) and cast their output back to the unit's ``param_dtype``. See backends/nn/README.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from dplab.backends.nn.fsdp_precision import COMPUTE_DTYPES, cast_floats, check_dtypes
from dplab.reference.errors import ConfigError

__all__ = ["MixedPrecision", "UnitPrecision", "Policy", "unit_precisions", "is_kept",
           "cast_kept_modules", "cast_unit_inputs"]


@dataclass(frozen=True)
class MixedPrecision:
    """torch.distributed.fsdp.MixedPrecision's three dtypes; ``None``: the master dtype.

    Attributes:
        param_dtype: the dtype of the gather, forward and backward (float16, bfloat16).
        reduce_dtype: the dtype of the gradients' reduce-scatter.
        buffer_dtype: the dtype the unit's floating-point buffers compute in.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


Policy = MixedPrecision | Mapping[nn.Module, MixedPrecision] | None


@dataclass(frozen=True)
class UnitPrecision:
    """One unit's policy, checked: ``compute`` None when it is the master dtype."""

    compute: torch.dtype | None
    reduce: torch.dtype
    buffer: torch.dtype | None


def unit_precisions(policy: Policy, units: Sequence[nn.Module], master: torch.dtype, comm: Any,
                    device: torch.device) -> list[UnitPrecision]:
    """Each unit's checked policy, the root (``units[0]``, the wrapped module) first."""
    if isinstance(policy, Mapping):
        known = {id(u) for u in units}
        if any(id(u) not in known for u in policy):
            raise ConfigError("mixed_precision maps a module that is not a unit: its keys must "
                              "be the listed units or the wrapped module itself (the root)")
        chosen = [policy.get(u) for u in units]
    else:
        chosen = [policy] * len(units)
    return [_check(mp or MixedPrecision(), master, comm, device) for mp in chosen]


def _check(mp: MixedPrecision, master: torch.dtype, comm: Any,
           device: torch.device) -> UnitPrecision:
    if not isinstance(mp, MixedPrecision):
        raise ConfigError(f"mixed_precision must be a MixedPrecision or a mapping of units to one, "
                          f"got {type(mp).__name__}")
    compute, reduce = check_dtypes(mp.param_dtype, mp.reduce_dtype, master, comm, device)
    if mp.buffer_dtype is not None and mp.buffer_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"buffer_dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))} "
                          f"or None, got {mp.buffer_dtype!r}")
    return UnitPrecision(compute, reduce, None if mp.buffer_dtype == master else mp.buffer_dtype)


def is_kept(holders: Sequence[tuple[nn.Module, str]], keep: tuple[type, ...]) -> bool:
    """Whether a parameter stays in the master dtype: every module holding it is a kept class."""
    return bool(keep) and all(isinstance(mod, keep) for mod, _ in holders)


def cast_unit_inputs(dtype: torch.dtype, _module: nn.Module, args: Any,
                     kwargs: Any) -> tuple[Any, Any]:
    """Forward pre-hook (``with_kwargs=True``): the unit's floating inputs in its compute dtype."""
    return cast_floats(args, dtype), cast_floats(kwargs, dtype)


def _cast_output(dtype: torch.dtype, _module: nn.Module, _args: Any, output: Any) -> Any:
    return cast_floats(output, dtype)


def cast_kept_modules(module: nn.Module, keep: tuple[type, ...], unit_of: Mapping[int, int],
                      precisions: Sequence[UnitPrecision], master: torch.dtype) -> None:
    """Hooks on every kept module inside a low-precision unit: inputs up to ``master``, outputs
    back to the unit's compute dtype."""
    for mod in module.modules():
        compute = precisions[unit_of.get(id(mod), 0)].compute
        if keep and isinstance(mod, keep) and compute is not None:
            mod.register_forward_pre_hook(partial(cast_unit_inputs, master), with_kwargs=True)
            mod.register_forward_hook(partial(_cast_output, compute))
