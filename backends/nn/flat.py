"""Flat buffers: what DDP, ZeRO-1 and FSDP keep their parameters and gradients in.

One contiguous buffer per dtype holds many parameters (``flat_layout`` says which slice is whose),
so a collective moves them all in one call and, on the local backend, straight out of shared
memory (``flat_buffer``). ``sum_batch_sizes`` is the one all-reduce the wrappers use to weight
uneven shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dplab.backends.fastpath.executor import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError

__all__ = ["flat_buffer", "flat_layout", "dtype_and_device", "sum_batch_sizes"]


def flat_buffer(comm: Communicator, n: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Any, torch.Tensor]:
    """One flat buffer of ``n`` elements: (what the collectives get, a tensor view of it).

    CPU tensors live in ``comm.empty`` memory (shared memory on the local backend, so sends
    are zero-copy) seen through ``torch.from_numpy``. Tensors on a GPU stay there and need
    a communicator on that GPU (the torch backend over NCCL), the only one that moves them.
    """
    if device.type == "cpu":
        buf = comm.empty(n, torch.empty(0, dtype=dtype).numpy().dtype)
        return buf, (buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf))
    if getattr(comm, "device", None) != device:
        raise ConfigError(f"parameters on {device} need a communicator on {device} (the "
                          f"torch backend with DPLAB_DEVICE=cuda); {type(comm).__name__} moves "
                          "host memory: use the CPU")
    t = torch.empty(n, dtype=dtype, device=device)
    return t, t


def sum_batch_sizes(comm: Communicator, n: int, scratch: tuple[Any, torch.Tensor],
                    algorithm: str = "ring") -> int:
    """Every rank's ``n`` summed (one all-reduce; ``scratch`` is a ``flat_buffer`` of 2 int64). A
    bad ``n`` is counted rather than raised at once, so that every rank raises and none hangs."""
    ok = type(n) is int and n >= 0
    buf, counts = scratch
    counts.copy_(torch.tensor([n if ok else 0, 0 if ok else 1]))
    allreduce(comm, buf, algorithm)
    total, bad = (int(v) for v in counts.cpu())
    if bad or not total:
        raise ConfigError(f"local_batch_size must be an integer >= 0 on every rank, not 0 on all; "
                          f"this rank passed {n!r}, {bad} rank(s) passed no integer >= 0")
    return total


def flat_layout(params: Sequence[torch.Tensor]) -> list[slice]:
    """Each parameter's slice of the flat buffer, one after another in the given order."""
    slices, start = [], 0
    for p in params:
        slices.append(slice(start, start + p.numel()))
        start += p.numel()
    return slices


def dtype_and_device(params: Sequence[torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    """The one dtype and device of ``params``: a flat buffer holds a single kind of number."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ConfigError("trainable parameters must share one dtype and device, got "
                          f"{sorted(map(str, kinds))}: call module.to(dtype) first")
    dtype, device = kinds.pop() if kinds else (torch.float32, torch.device("cpu"))
    if dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"gradients of dtype {dtype} cannot be reduced: use float32 or float64")
    return dtype, device
