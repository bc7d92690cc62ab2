"""FSDP's full parameters: summoned into the module for a while, or as a plain state dict.

    with fsdp.summon_full_params():       # the module's attributes: full fp32 parameters, every rank
        fsdp.module.head.weight.mul_(2)   # written back to the shards at exit (writeback=True)
    sd = fsdp.full_state_dict()           # the plain module's state dict, the same on every rank
    fsdp.load_full_state_dict(sd)         # each rank keeps its chunks, no communication

A mixin of ``FullyShardedDataParallel`` (``fsdp.py``), which provides the attributes it reads:
the flats, the memory meter, the wrapped module and the state-dict keys of its parameters
(several for a tied weight) and buffers. Summoning gathers the fp32 masters (not the compute
dtype's copies), so a state dict holds exactly what the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dplab.backends.nn.fsdp_flat import FlatParam, MemoryMeter, show
from dplab.reference.errors import ConfigError

__all__ = ["FullParams"]


class FullParams:
    """summon_full_params, full_state_dict, load_full_state_dict for FSDP."""

    module: nn.Module
    meter: MemoryMeter
    _summoned: bool
    _state_keys: list[str]
    _param_keys: dict[str, int]
    _buffer_dtypes: dict[str, torch.dtype]
    _flat_keys: list[list[str]]

    def _flats(self) -> list[FlatParam]:
        raise NotImplementedError

    @contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Inside, the module's attributes are the full parameters in the master dtype, on every
        rank; with ``writeback`` each rank's chunk of what they hold at exit goes back to its shard.
        A collective: call it on every rank, outside forward and backward."""
        if self._summoned or any(f.gathered for f in self._flats()):
            raise ConfigError("summon_full_params() inside forward, backward or another summon: "
                              "call it between steps")
        fulls = []
        try:
            for flat in self._flats():
                full = flat.full_master()
                fulls.append(full)
                for s, shape, holders in zip(flat.slices, flat.shapes, flat.holders):
                    show(holders, full[s].view(shape))
            self._summoned = True
            yield
            if writeback:
                for flat, full in zip(self._flats(), fulls):
                    flat.load_full(full)
        finally:
            self._summoned = False
            for flat, full in zip(self._flats(), fulls):
                flat.free()
                self.meter.add(-full.numel() * full.element_size())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's ``state_dict()`` as if it were never wrapped, the same on every rank:
        full parameters in the master dtype, buffers in their original dtype. A collective."""
        out = {}
        with self.summon_full_params(writeback=False):
            for key in self._state_keys:
                if key in self._param_keys:
                    prefix, _, name = key.rpartition(".")
                    value = getattr(self.module.get_submodule(prefix), name)
                else:
                    value = self.module.get_buffer(key).to(self._buffer_dtypes[key])
                out[key] = value.detach().clone()
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a plain module's state dict: each rank keeps its chunks (no communication; pass
        the same dict on every rank)."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if missing or unexpected:
            raise ConfigError(f"state dict does not fit the wrapped module: missing {missing}, "
                              f"unexpected {unexpected}")
        for flat, keys in zip(self._flats(), self._flat_keys):
            flat.load_full(torch.cat([state_dict[k].reshape(-1).to(flat.master_dtype) for k in keys]))
        with torch.no_grad():
            for key in self._buffer_dtypes:
                buf = self.module.get_buffer(key)
                buf.copy_(state_dict[key].to(buf.dtype))
