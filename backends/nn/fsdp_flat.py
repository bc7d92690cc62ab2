"""One FSDP unit's parameters as a flat shard, gathered into a full flat tensor only while needed.

    flat = FlatParam(comm, [w, b], holders, compute_dtype=None, trainable=True)
    flat.shard           # this rank's chunk_bounds(n, p)[rank] of [ w | b ] (fp32/fp64)
    w.data, b.data       # 1-D views into flat.shard: this rank's part of w (of b), maybe empty
    flat.gather()        # leaf = the whole [ w | b ] in the compute dtype
    flat.use_views()     # module attributes (module.weight) = full views of the leaf, for forward
    flat.free()          # leaf's storage resized to 0 bytes; module attributes = w and b again
    flat.reduce_grad(weight)   # leaf.grad -> reduce-scatter -> w.grad, b.grad = views of shard.grad
    flat.hold_grad()     # no_sync: leaf.grad summed in ``held`` (full, master dtype), reduced later

The module's ``_parameters`` never change (names, objects, order); while a unit runs, the full
views shadow them as instance attributes. ``free`` resizes the storage instead of dropping the
tensor, so the views autograd saved for backward see the weights again after the next ``gather``,
as in torch's FSDP. A bf16 gather gives the bits of an fp32 gather cast after; on the local and MPI
backends it travels as float16 bytes, and a bf16 *reduction* needs the torch backend.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dplab.backends.fastpath.executor import allgather, reduce_scatter
from dplab.backends.nn.flat import flat_layout
from dplab.reference.communicator import Communicator
from dplab.reference.schedule import chunk_bounds

__all__ = ["FlatParam", "Holder", "MemoryMeter", "show", "unshow"]

Holder = tuple[nn.Module, str]  # (module, attribute name): where a parameter is read from


def show(holders: Sequence[Holder], tensor: torch.Tensor) -> None:
    """Make ``module.name`` read ``tensor`` for every holder, over the registered parameter."""
    for mod, name in holders:
        # the instance dict, found before nn.Module.__getattr__
        object.__setattr__(mod, name, tensor)


def unshow(holders: Sequence[Holder]) -> None:
    """Undo ``show``: ``module.name`` is the registered (sharded) parameter again."""
    for mod, name in holders:
        mod.__dict__.pop(name, None)


class MemoryMeter:
    """Bytes of gathered (unsharded) parameter storage alive now, and the most seen at once.
    Thread-safe: with prefetch, gathers fill leaves on the comm thread
    while frees run on the main."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self.peak = self.now


class FlatParam:
    """Parameters of one unit that share ``requires_grad``: a flat shard and a gatherable leaf."""

    def __init__(self, comm: Communicator, params: Sequence[torch.Tensor],
                 holders: Sequence[list[Holder]],
                 compute_dtype: torch.dtype, trainable: bool, meter: MemoryMeter, algorithm: str,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.comm, self.meter, self.algorithm, self.trainable = comm, meter, algorithm, trainable
        self.holders = [list(h) for h in holders]
        self.shapes = [p.shape for p in params]
        self.slices = flat_layout(params)
        self.n = self.slices[-1].stop if self.slices else 0
        self.master_dtype, device = params[0].dtype, params[0].device
        self.reduce_dtype = reduce_dtype or self.master_dtype
        self.held: torch.Tensor | None = None  # no_sync's accumulated full gradient (master dtype)
        self.bounds = chunk_bounds(self.n, comm.world_size)[comm.rank]
        self.params = list(params)
        self.pieces = [_piece(s, self.bounds) for s in self.slices]
        with torch.no_grad():
            full = torch.cat([p.detach().reshape(-1) for p in params])
            self.shard = nn.Parameter(full[slice(*self.bounds)].clone(), requires_grad=trainable)
        for p, (a, b) in zip(self.params, self.pieces):
            # the same Parameter object: optimizers built earlier still fit
            p.data = self.shard.detach()[a:b]
            p.grad = None
        self.leaf = torch.empty(self.n, dtype=compute_dtype, device=device)
        self.leaf.untyped_storage().resize_(0)
        self.leaf.requires_grad_(trainable)
        self.gathered = False
        self.free()

    @property
    def leaf_bytes(self) -> int:
        return self.n * self.leaf.element_size()

    def _allgather(self, full: torch.Tensor) -> torch.Tensor:
        """All-gather the shards into ``full`` (n elements, any dtype:
        the shard is cast), in place."""
        full[slice(*self.bounds)].copy_(self.shard.detach())
        allgather(self.comm, _buf(full, copy_only=True), self.algorithm)
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
        self._allgather(target)  # in the compute dtype: the shard is cast into its place, then sent

    def use_views(self) -> None:
        """Point the module attributes at views of the leaf, recorded
        by autograd when grad is on."""
        for s, shape, holders in zip(self.slices, self.shapes, self.holders):
            show(holders, self.leaf[s].view(shape))

    def full_master(self) -> torch.Tensor:
        """The full flat parameter in the master dtype, a new tensor (a collective: every rank)."""
        full = self._allgather(torch.empty(self.n, dtype=self.master_dtype,
                                           device=self.shard.device))
        self.meter.add(full.nbytes)
        return full

    @torch.no_grad()
    def full_grad(self) -> torch.Tensor:
        """The full flat gradient in the master dtype, from every rank's pieces (zeros where a
        piece has none), a new tensor (a collective: every rank)."""
        full = torch.zeros(self.n, dtype=self.master_dtype, device=self.shard.device)
        mine = full[slice(*self.bounds)]
        for p, (a, b) in zip(self.params, self.pieces):
            if p.grad is not None:
                mine[a:b] = p.grad.reshape(-1)
        allgather(self.comm, _buf(full, copy_only=True), self.algorithm)
        return full

    def free(self) -> None:
        """Drop the full parameters: the leaf's storage goes to 0 bytes, the module's attributes
        are its (sharded) parameters again."""
        if self.gathered:
            self.leaf.untyped_storage().resize_(0)
            self.meter.add(-self.leaf_bytes)
            self.gathered = False
        for holders in self.holders:
            unshow(holders)

    @torch.no_grad()
    def hold_grad(self) -> None:
        """no_sync: keep the full gradient for later instead of reducing it (in the master dtype,
        so that k micro-batches in bf16 are summed in fp32, not rounded to bf16 k times)."""
        grad, self.leaf.grad = self.leaf.grad, None
        if grad is None:
            return
        if self.held is None:
            self.held = grad.reshape(-1).to(self.master_dtype).contiguous()
        else:
            self.held.add_(grad.reshape(-1))

    @torch.no_grad()
    def reduce_grad(self, weight: float | None) -> None:
        """Average the full gradient (plus any ``held`` one) over ranks; this rank's chunk is added
        to ``shard.grad``.

        ``weight`` multiplies this rank's gradient before the sum (1/p, or n_r / N for shards of
        n_r samples); ``None`` contributes zeros (no gradient on this rank, or an empty shard).
        The weighting happens in the master dtype, then one cast to ``reduce_dtype`` (one rounding
        in float16, not two); the sum runs in ``reduce_dtype``, each partial sum rounded to it.
        """
        # the full gradient goes after this, not at zero_grad
        grad, self.leaf.grad = self.leaf.grad, None
        held, self.held = self.held, None
        if weight is None or (grad is None and held is None):
            g = torch.zeros(self.n, dtype=self.reduce_dtype, device=self.shard.device)
        # cast to the master dtype (a copy only in mixed precision), weight, cast to reduce_dtype
        else:
            g = held
            if grad is not None:
                mine = grad.reshape(-1).to(self.master_dtype)
                g = mine if g is None else g.add_(mine)
            g = g.contiguous().mul_(weight).to(self.reduce_dtype)
        reduce_scatter(self.comm, _buf(g), self.algorithm)
        self.set_shard_grad(g[slice(*self.bounds)].to(self.master_dtype, copy=True))

    def set_shard_grad(self, mine: torch.Tensor) -> None:
        """``shard.grad`` = ``mine`` plus what the parameters' ``.grad`` hold (a backward without
        ``zero_grad`` before it accumulates), and each parameter's ``.grad`` its view of it. Read
        from the parameters, not from ``shard.grad``: ``zero_grad`` only sees the parameters."""
        for p, (a, b) in zip(self.params, self.pieces):
            if p.grad is not None:
                mine[a:b].add_(p.grad.reshape(-1))
        self.shard.grad = mine
        for p, (a, b) in zip(self.params, self.pieces):
            p.grad = mine[a:b]

    def load_full(self, full: torch.Tensor) -> None:
        """Keep this rank's chunk of a full flat parameter (no communication)."""
        with torch.no_grad():
            self.shard.copy_(full[slice(*self.bounds)])


def _piece(s: slice, bounds: tuple[int, int]) -> tuple[int, int]:
    """Where a parameter's slice ``s`` of the flat lies in the shard ``bounds``, as shard offsets;
    an empty range when it lies in other ranks' chunks."""
    lo, hi = bounds
    a, b = max(s.start, lo), min(s.stop, hi)
    return (a - lo, b - lo) if a < b else (0, 0)


def _buf(t: torch.Tensor, copy_only: bool = False) -> Any:
    """What the collectives get: a CPU tensor as a numpy array over its memory, a GPU tensor as is.

    Not ``t.numpy()``: that marks the storage as not resizable, and the leaf's must stay
    resizable (``free``). The array is built from the address, used for one collective, dropped.
    A bfloat16 CPU tensor: for a collective that only copies (``copy_only``: the all-gather), a
    float16 array over the same bytes, which every backend moves bit for bit; for a reduction, the
    tensor itself (the torch backend adds bfloat16; FSDP refuses it on the others beforehand).
    """
    if t.device.type != "cpu" or (t.dtype == torch.bfloat16 and not copy_only):
        return t
    dtype = _NUMPY[t.dtype]
    if t.numel() == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * t.nbytes).from_address(t.data_ptr()), dtype=dtype)


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.bfloat16: np.float16}  # bfloat16: its bits as float16, for copies only (see _buf)
