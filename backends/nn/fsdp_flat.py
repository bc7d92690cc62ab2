"""One FSDP unit's parameters as a flat shard, gathered into a full flat tensor only while needed.

    flat = FlatParam(comm, [w, b], holders, compute_dtype=None, trainable=True)
    flat.shard           # this rank's chunk_bounds(n, p)[rank] of [ w | b ] (fp32/fp64)
    w.data, b.data       # 1-D views into flat.shard: the part of w (of b) this rank stores, maybe empty
    flat.gather()        # leaf = the whole [ w | b ] in the compute dtype
    flat.use_views()     # module attributes (module.weight) = full views of the leaf, for the forward
    flat.free()          # leaf's storage resized to 0 bytes; module attributes = w and b again
    flat.reduce_grad(weight)   # leaf.grad -> reduce-scatter -> w.grad, b.grad = views of shard.grad

The original parameters stay the module's parameters, as torch's FSDP1 with ``use_orig_params``
does: each keeps its name, its object and ``requires_grad``, but its ``.data`` becomes the piece
of this rank's flat shard that it covers (1-D; empty when it lies in other ranks' chunks), and its
``.grad`` the matching piece of the sharded gradient. So an optimizer built from
``model.parameters()`` steps the shard in place, with no copy and no second parameter to keep in
step, and ``named_parameters()`` logs original names. The module's ``_parameters`` are never
changed: while a unit runs, the full views *shadow* them as plain instance attributes
(``object.__setattr__``, which nn.Module's own ``__setattr__`` refuses for a parameter's name),
and ``free`` removes the shadow. Names and order of ``named_parameters()`` stay the module's.

Why the storage is resized instead of the tensor dropped: autograd keeps the views of ``leaf``
that forward used (a linear layer saves its weight for backward). Resizing the storage to zero
frees the memory but keeps those saved tensors pointing at the same storage; ``gather`` before
the unit's backward resizes it back and fills it again, so the saved views see the weights
again. That is how torch's FSDP frees its flat parameter. Writes go through ``leaf.data``,
whose version counter is not the leaf's, so autograd does not object to the refill.

The all-gather writes straight into the leaf's storage, in the compute dtype: this rank's fp32
chunk is cast into its place in the leaf and the leaf is all-gathered, so a bf16 gather moves
half the bytes of an fp32 one. It is the same bits as gathering fp32 and casting after (a cast
acts element by element; where it happens does not matter). The reduce-scatter runs in place on
the full gradient in ``reduce_dtype``: on MPI and torch.distributed nothing is copied. These
buffers are torch's, not ``comm.empty`` shared memory (that cannot be resized), so on the local
backend each send is staged (copied once; ``comm.bytes_staged`` counts it).

bfloat16 on the local and MPI backends, which move numpy arrays (numpy has no bfloat16): an
all-gather only copies, never adds, so the bf16 leaf travels as a float16 array over the same
bytes (``_buf``), bit for bit, on every backend. A *reduction* in bfloat16 must add, which only
the torch backend can: FSDP refuses ``reduce_dtype=torch.bfloat16`` elsewhere (``fsdp_precision``).

    flat.hold_grad()     # no_sync: leaf.grad (any dtype) added into ``held``, a master-dtype full
                         # gradient, instead of being reduced; the next reduce_grad sends held + grad
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
        object.__setattr__(mod, name, tensor)  # the instance dict, found before nn.Module.__getattr__


def unshow(holders: Sequence[Holder]) -> None:
    """Undo ``show``: ``module.name`` is the registered (sharded) parameter again."""
    for mod, name in holders:
        mod.__dict__.pop(name, None)


class MemoryMeter:
    """Bytes of gathered (unsharded) parameter storage alive now, and the most seen at once.
    Thread-safe: with prefetch, gathers fill leaves on the comm thread while frees run on the main."""

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

    def __init__(self, comm: Communicator, params: Sequence[torch.Tensor], holders: Sequence[list[Holder]],
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
            p.data = self.shard.detach()[a:b]  # the same Parameter object: optimizers built earlier still fit
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
        """All-gather the shards into ``full`` (n elements, any dtype: the shard is cast), in place."""
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
        """Point the module attributes at views of the leaf, recorded by autograd when grad is on."""
        for s, shape, holders in zip(self.slices, self.shapes, self.holders):
            show(holders, self.leaf[s].view(shape))

    def full_master(self) -> torch.Tensor:
        """The full flat parameter in the master dtype, a new tensor (a collective: every rank)."""
        full = self._allgather(torch.empty(self.n, dtype=self.master_dtype, device=self.shard.device))
        self.meter.add(full.nbytes)
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
        grad, self.leaf.grad = self.leaf.grad, None  # the full gradient goes after this, not at zero_grad
        held, self.held = self.held, None
        if weight is None or (grad is None and held is None):
            g = torch.zeros(self.n, dtype=self.reduce_dtype, device=self.shard.device)
        else:  # cast to the master dtype (a copy only in mixed precision), weight, cast to reduce_dtype
            g = held
            if grad is not None:
                mine = grad.reshape(-1).to(self.master_dtype)
                g = mine if g is None else g.add_(mine)
            g = g.contiguous().mul_(weight).to(self.reduce_dtype)
        reduce_scatter(self.comm, _buf(g), self.algorithm)
        self.set_shard_grad(g[slice(*self.bounds)].to(self.master_dtype, copy=True))

    def set_shard_grad(self, mine: torch.Tensor) -> None:
        """``shard.grad`` = ``mine`` plus what the parameters' ``.grad`` hold (a backward without
        ``zero_grad`` before it accumulates), and each parameter's ``.grad`` its view of it. Read from
        the parameters, not from ``shard.grad``: ``zero_grad`` only sees the parameters."""
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
