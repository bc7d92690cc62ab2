"""One FSDP unit's parameters as a flat shard, gathered into a full flat tensor only while needed.

    flat = FlatParam(comm, [w, b], holders, compute_dtype=None, trainable=True)
    flat.shard           # nn.Parameter: this rank's chunk_bounds(n, p)[rank] of [ w | b ] (fp32/fp64)
    flat.gather()        # leaf = the whole [ w | b ] in the compute dtype; module attributes = its views
    flat.free()          # leaf's storage resized to 0 bytes; module attributes = empty placeholders
    flat.reduce_grad(weight)   # leaf.grad -> reduce-scatter -> shard.grad += this rank's chunk

Why the storage is resized instead of the tensor dropped: autograd keeps the views of ``leaf``
that forward used (a linear layer saves its weight for backward). Resizing the storage to zero
frees the memory but keeps those saved tensors pointing at the same storage; ``gather`` before
the unit's backward resizes it back and fills it again, so the saved views see the weights
again. That is how torch's FSDP frees its flat parameter. Writes go through ``leaf.data``,
whose version counter is not the leaf's, so autograd does not object to the refill.

The all-gather writes straight into the leaf's storage (in the compute dtype only when that is
the master dtype; otherwise into a transient full tensor in the master dtype, then cast), and
the reduce-scatter runs in place on the full gradient: on MPI and torch.distributed nothing is
copied. These buffers are torch's, not ``comm.empty`` shared memory (that cannot be resized),
so on the local backend each send is staged (copied once; ``comm.bytes_staged`` counts it).
Gradients are cast to the master dtype (fp32) *before* the reduction: we reduce in fp32, not in
the compute dtype (our collectives move float32 and float64 only).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dplab.backends.nn.ddp import flat_layout
from dplab.reference.collectives import allgather, reduce_scatter
from dplab.reference.communicator import Communicator
from dplab.reference.schedule import chunk_bounds

__all__ = ["FlatParam", "Holder", "MemoryMeter"]

Holder = tuple[nn.Module, str]  # (module, attribute name): where a parameter is read from


class MemoryMeter:
    """Bytes of gathered (unsharded) parameter storage alive now, and the most seen at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self.peak = self.now


class FlatParam:
    """Parameters of one unit that share ``requires_grad``: a flat shard and a gatherable leaf."""

    def __init__(self, comm: Communicator, params: Sequence[torch.Tensor], holders: Sequence[list[Holder]],
                 compute_dtype: torch.dtype, trainable: bool, meter: MemoryMeter, algorithm: str) -> None:
        self.comm, self.meter, self.algorithm, self.trainable = comm, meter, algorithm, trainable
        self.holders = [list(h) for h in holders]
        self.shapes = [p.shape for p in params]
        self.slices = flat_layout(params)
        self.n = self.slices[-1].stop if self.slices else 0
        self.master_dtype, device = params[0].dtype, params[0].device
        self.bounds = chunk_bounds(self.n, comm.world_size)[comm.rank]
        with torch.no_grad():
            full = torch.cat([p.detach().reshape(-1) for p in params])
            self.shard = nn.Parameter(full[slice(*self.bounds)].clone(), requires_grad=trainable)
        self.leaf = torch.empty(self.n, dtype=compute_dtype, device=device)
        self.leaf.untyped_storage().resize_(0)
        self.leaf.requires_grad_(trainable)
        self.placeholders = [torch.empty(0, dtype=compute_dtype, device=device) for _ in params]
        self.gathered = False
        self.free()

    @property
    def leaf_bytes(self) -> int:
        return self.n * self.leaf.element_size()

    def _allgather(self, full: torch.Tensor) -> torch.Tensor:
        """All-gather the shards into ``full`` (n elements, master dtype), in place."""
        full[slice(*self.bounds)].copy_(self.shard.detach())
        allgather(self.comm, _buf(full), self.algorithm)
        return full

    @torch.no_grad()
    def gather(self) -> None:
        """Fill the leaf with the full parameters (a collective); a no-op if already gathered."""
        if self.gathered:
            return
        self.leaf.untyped_storage().resize_(self.leaf_bytes)
        self.meter.add(self.leaf_bytes)
        self.gathered = True
        target = self.leaf.data  # .data: a fresh version counter, autograd's saved views stay valid
        if target.dtype == self.master_dtype:
            self._allgather(target)
        else:  # mixed precision: gather the fp32 masters, then cast; the fp32 copy is transient
            full = self._allgather(torch.empty(self.n, dtype=self.master_dtype, device=target.device))
            self.meter.add(full.nbytes)
            target.copy_(full)
            self.meter.add(-full.nbytes)

    def use_views(self) -> None:
        """Point the module attributes at views of the leaf, recorded by autograd when grad is on."""
        for s, shape, holders in zip(self.slices, self.shapes, self.holders):
            view = self.leaf[s].view(shape)
            for mod, name in holders:
                setattr(mod, name, view)

    def full_master(self) -> torch.Tensor:
        """The full flat parameter in the master dtype, a new tensor (a collective: every rank)."""
        full = self._allgather(torch.empty(self.n, dtype=self.master_dtype, device=self.shard.device))
        self.meter.add(full.nbytes)
        return full

    def free(self) -> None:
        """Drop the full parameters: the leaf's storage goes to 0 bytes, attributes to placeholders."""
        if self.gathered:
            self.leaf.untyped_storage().resize_(0)
            self.meter.add(-self.leaf_bytes)
            self.gathered = False
        for holders, empty in zip(self.holders, self.placeholders):
            for mod, name in holders:
                setattr(mod, name, empty)

    @torch.no_grad()
    def reduce_grad(self, weight: float | None) -> None:
        """Average the full gradient over ranks; this rank's chunk is added to ``shard.grad``.

        ``weight`` multiplies this rank's gradient before the sum (1/p, or n_r / N for shards of
        n_r samples); ``None`` contributes zeros (no gradient on this rank, or an empty shard).
        """
        grad, self.leaf.grad = self.leaf.grad, None  # the full gradient goes after this, not at zero_grad
        if weight is None or grad is None:
            g = torch.zeros(self.n, dtype=self.master_dtype, device=self.shard.device)
        else:  # cast to the master dtype before reducing (a copy only in mixed precision)
            g = grad.reshape(-1).to(self.master_dtype).contiguous()
            g.mul_(weight)
        reduce_scatter(self.comm, _buf(g), self.algorithm)
        mine = g[slice(*self.bounds)]
        if self.shard.grad is None:
            self.shard.grad = mine.clone()
        else:
            self.shard.grad.add_(mine)

    def load_full(self, full: torch.Tensor) -> None:
        """Keep this rank's chunk of a full flat parameter (no communication)."""
        with torch.no_grad():
            self.shard.copy_(full[slice(*self.bounds)])


def _buf(t: torch.Tensor) -> Any:
    """What the collectives get: a CPU tensor as a numpy array over its memory, a GPU tensor as is.

    Not ``t.numpy()``: that marks the storage as not resizable, and the leaf's must stay
    resizable (``free``). The array is built from the address, used for one collective, dropped.
    """
    if t.device.type != "cpu":
        return t
    dtype = _NUMPY[t.dtype]
    if t.numel() == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * t.nbytes).from_address(t.data_ptr()), dtype=dtype)


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
