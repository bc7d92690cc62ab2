"""FSDP's mixed precision: the dtypes checked, the root's inputs and the buffers cast per forward.

    compute, reduce = check_dtypes(torch.bfloat16, None, torch.float32, comm)  # (bf16, fp32)
    args, kwargs = cast_floats((args, kwargs), torch.bfloat16)   # floating tensors only
    masters = cast_buffers(float_buffers)   # (module, name, dtype): the module sees bf16 copies
    out = module(*args, **kwargs)
    restore_buffers(float_buffers, masters)                      # its own fp32 buffers back

The buffers are cast for each forward instead of once for all, so that the module's own stay in
their dtype: a state dict keeps the fp32 values (a bf16 round trip would change them). A buffer
that forward changed in place (BatchNorm's running statistics) passes the change to its master.
"Changed" is read from the values, not from the tensor's version counter: BatchNorm's kernel
writes its running statistics without bumping it (``bn(x)`` leaves ``running_mean._version`` at
0), so a version check never saw the update and the statistics stayed at their initial values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dplab.reference.errors import ConfigError

__all__ = ["COMPUTE_DTYPES", "check_dtypes", "cast_floats", "tensors_in", "cast_buffers",
           "restore_buffers"]

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# (module's buffer, its cast copy, the copy's version)
Masters = list[tuple[torch.Tensor, torch.Tensor, int]]


def check_dtypes(compute: torch.dtype | None, reduce: torch.dtype | None, master: torch.dtype,
                 comm: Any, device: torch.device | None = None
                 ) -> tuple[torch.dtype | None, torch.dtype]:
    """(compute dtype or None when it is the master's, reduce dtype), or a ConfigError saying what
    to do.

    A bfloat16 reduction adds bfloat16 numbers: only the torch backend carries them (or a GPU
    tensor); the local and MPI backends move numpy arrays, and numpy has no bfloat16. Refused
    there, on every rank at construction, rather than silently reduced in float32: the caller
    asked for the halved bytes and would not get them. (A bfloat16 *gather* works everywhere: it
    only copies, see ``fsdp_flat._buf``.)
    """
    for name, dtype in (("compute_dtype", compute), ("reduce_dtype", reduce)):
        if dtype is not None and dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"{name} must be one of {', '.join(map(str, COMPUTE_DTYPES))} "
                              f"or None, got {dtype!r}")
    backend = getattr(comm, "backend", "")
    host = device is None or device.type == "cpu"
    # numpy carries them
    if reduce == torch.bfloat16 and host and not getattr(comm, "host_tensors", False):
        raise ConfigError(f"reduce_dtype=torch.bfloat16 cannot be reduced on the {backend} "
                          "backend (it moves numpy arrays; numpy has no bfloat16): use "
                          "reduce_dtype=torch.float16 or torch.float32, or backend='torch'")
    return (None if compute in (None, master) else compute), (reduce or master)


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in nested tuples, lists and dicts cast
    to ``dtype``; the rest as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def cast_buffers(buffers: list[tuple[nn.Module, str, torch.dtype]]) -> Masters:
    """Give each (module, name, dtype) a ``dtype`` copy of its buffer for one forward."""
    out = []
    for mod, name, dtype in buffers:
        master = mod._buffers[name]
        low = mod._buffers[name] = master.to(dtype)
        out.append((master, low, low._version))
    return out


def restore_buffers(buffers: list[tuple[nn.Module, str, torch.dtype]], masters: Masters) -> None:
    """The module's own buffers back; one that forward changed in place takes the change (the
    version counter catches Python's in-place ops, the comparison with
    a fresh cast the kernels')."""
    for (mod, name, _), (master, low, version) in zip(buffers, masters):
        mod._buffers[name] = master
        if low._version != version or not torch.equal(low, master.to(low.dtype)):
            with torch.no_grad():
                master.copy_(low)
