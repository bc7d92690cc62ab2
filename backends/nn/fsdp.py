"""Fully sharded data parallelism (ZeRO stage 3) for torch modules, over our collectives.

    from dplab.backends.nn.fsdp import FSDP
    def train(comm):
        model = Net()
        fsdp = FSDP(model, comm, units=list(model.blocks))   # rank 0's weights, then sharded
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # steps this rank's flat shards only
        for x, y in my_shard_of_each_batch:
            opt.zero_grad()
            loss_fn(fsdp(x), y).backward()    # gathers each unit before its forward and backward
            opt.step()
        return fsdp.full_state_dict()         # every rank: the plain module's state dict

    launch(train, 4)                          # backend="mpi" or "torch" too

Data parallelism keeps every weight on every rank; ZeRO-1 (``zero.py``) shards the optimizer
state. FSDP shards the weights too: each *unit* (a submodule you list; the root, the wrapped
module, holds every parameter no listed unit holds) keeps its parameters as one flat tensor of
which each rank stores only its chunk, ``chunk_bounds(n, p)[rank]``. A unit's full parameters
exist only while it runs:

    forward,  unit k:  all-gather flat k -> run unit k -> free flat k
    backward, unit k:  all-gather flat k -> unit k's backward -> reduce-scatter grad k -> free both

so a rank holds its shards plus the units in flight, not the model: with U units of equal size,
about n/p + (1 or 2) n/U instead of n. The price is communication: a gather in forward, one in
backward and a reduce-scatter, 1.5x the bytes of DDP's all-reduce. Gradients are averaged as
DDP does (sum / p, or each rank's weighted by ``local_batch_size`` / global batch).

Mixed precision: ``compute_dtype=torch.bfloat16`` (or float16) gathers the fp32 shards, casts
the full parameters (and the root's floating inputs, and for each forward the buffers) to bf16 for forward and
backward, and casts each gradient back to fp32 *before* the reduce-scatter: the reduction and
the optimizer work on fp32 masters. (Reducing in bf16 would halve the bytes; our collectives
move float32/float64 only.) No loss scaling here: float16 gradients may underflow.

Frozen parameters (``requires_grad=False``) get a flat shard of their own that is gathered but
never reduced and has no gradient, so optimizers skip it. A parameter tied between modules (an
embedding reused as the output projection) is flattened once, in the unit holding all its uses
(``fsdp_units``). ``summon_full_params()`` puts the full fp32 parameters back into the module for
a while (a collective); ``full_state_dict()`` returns the plain module's state dict on every
rank, ``load_full_state_dict`` takes one. ``param_memory()`` counts parameter bytes per rank.
Gathers and reductions run on the autograd thread (no overlap with compute, unlike ``ddp.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from dplab.backends.nn.ddp import broadcast_module, dtype_and_device, flat_buffer
from dplab.backends.nn.fsdp_flat import FlatParam, MemoryMeter
from dplab.backends.nn.fsdp_precision import cast_buffers, cast_floats, restore_buffers, tensors_in
from dplab.backends.nn.fsdp_units import param_keys, plan_units
from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError

__all__ = ["FullyShardedDataParallel", "FSDP", "COMPUTE_DTYPES"]

SCATTER_ALGORITHMS = ("ring", "direct")  # those with a reduce_scatter and an allgather schedule
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class FullyShardedDataParallel(nn.Module):
    """Wraps ``module``: its parameters become flat shards, gathered per unit while it runs.

    Args:
        units: submodules that each get their own flat parameter (none may contain another);
            ``None``: the whole model is one unit. Their order is the order of ``parameters()``.
        compute_dtype: dtype of forward and backward (float16, bfloat16); masters, gradients
            reduced and optimizer stay in the module's dtype. ``None``: the module's dtype.
        algorithm: ``ring`` or ``direct`` (the schedules with a reduce-scatter and all-gather).
        local_batch_size: this rank's shard size, for uneven shards (as in ``DDP``).
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, units: Sequence[nn.Module] | None = None,
                 compute_dtype: torch.dtype | None = None, algorithm: str = "ring",
                 local_batch_size: int | None = None) -> None:
        super().__init__()
        if algorithm not in SCATTER_ALGORITHMS:
            raise ConfigError(f"FSDP needs a reduce-scatter and an all-gather: algorithm must be one of "
                              f"{', '.join(SCATTER_ALGORITHMS)}, got {algorithm!r}")
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))} or None, "
                              f"got {compute_dtype!r}")
        plans = plan_units(module, units)  # checked before any collective: a bad unit fails alone
        master, device = dtype_and_device(list(module.parameters()))
        if device.type != "cpu":
            flat_buffer(comm, 0, master, device)  # raises unless the communicator moves that device's memory
        self.module, self.comm, self.algorithm, self.device = module, comm, algorithm, device
        self.compute_dtype = compute_dtype if compute_dtype not in (None, master) else None
        broadcast_module(module, comm)
        self._state_keys = list(module.state_dict().keys())
        self._param_keys = param_keys(module)
        self._buffer_dtypes = {k: module.get_buffer(k).dtype for k in self._state_keys
                               if k not in self._param_keys}
        first_key = {}
        for key, pid in self._param_keys.items():
            first_key.setdefault(pid, key)
        self.meter = MemoryMeter()
        self.unit_names = [p.name for p in plans]
        self.units: list[list[FlatParam]] = []
        self._flat_keys: list[list[str]] = []  # per flat: the state-dict key of each of its parameters
        cdt = self.compute_dtype or master
        for plan in plans:
            for holders in plan.holders:
                for mod, name in holders:
                    del mod._parameters[name]  # the module reads a plain attribute from now on
            flats = []
            for trainable in (True, False):
                idx = [i for i, p in enumerate(plan.params) if p.requires_grad == trainable]
                if idx:
                    params, holders = [plan.params[i] for i in idx], [plan.holders[i] for i in idx]
                    flats.append(FlatParam(comm, params, holders, cdt, trainable, self.meter, algorithm))
                    self._flat_keys.append([first_key[id(plan.params[i])] for i in idx])
            self.units.append(flats)
        self.flat_params = nn.ParameterList([f.shard for flats in self.units for f in flats])
        self._float_buffers = [] if self.compute_dtype is None else [
            (mod, name) for mod in module.modules() for name, b in mod._buffers.items()
            if b is not None and b.is_floating_point()]
        for k, flats in enumerate(self.units):
            for f in flats:
                if f.trainable:
                    f.leaf.register_post_accumulate_grad_hook(partial(self._grad_ready, f))
            if k:
                plans[k].module.register_forward_pre_hook(partial(self._pre_forward, k))
                plans[k].module.register_forward_hook(partial(self._post_forward, k))
        self._pending: list[FlatParam] = []  # trainable flats used in forward, not reduced yet
        self._callback_queued = False
        self._summoned = False
        self.local_batch_size: int | None = None
        self.global_batch_size: int | None = None
        if local_batch_size is not None:
            self.set_local_batch_size(local_batch_size)

    def _flats(self) -> list[FlatParam]:
        return [f for flats in self.units for f in flats]

    # -- forward and backward ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with its root unit gathered; each listed unit gathers itself."""
        if self._summoned:
            raise ConfigError("forward inside summon_full_params(): leave the context first")
        self._pending.clear()  # a forward whose backward never ran (evaluation) leaves nothing behind
        if self.compute_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.compute_dtype)
        self._pre_forward(0)
        masters = cast_buffers(self._float_buffers, self.compute_dtype)
        try:
            output = self.module(*args, **kwargs)
        finally:
            restore_buffers(self._float_buffers, masters)
        return self._post_forward(0, None, None, output)

    def _pre_forward(self, k: int, *_: Any) -> None:
        for f in self.units[k]:
            f.gather()
            f.use_views()
            if f.trainable and torch.is_grad_enabled() and f not in self._pending:
                self._pending.append(f)

    def _post_forward(self, k: int, _module: Any, _args: Any, output: Any) -> Any:
        for f in self.units[k]:
            f.free()
        if torch.is_grad_enabled() and self.units[k]:
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, k))
        return output

    def _pre_backward(self, k: int, _grad: torch.Tensor) -> None:
        """The gradient of unit k's output exists: its backward is next, gather its parameters."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for f in self.units[k]:
            f.gather()

    def _grad_ready(self, flat: FlatParam, _leaf: torch.Tensor) -> None:
        """Autograd's word that the flat's full gradient is complete: reduce-scatter it, free it."""
        flat.reduce_grad(self._weight())
        flat.free()
        if flat in self._pending:
            self._pending.remove(flat)

    def _end_backward(self) -> None:
        """After backward: flats that got no gradient reduce zeros (every rank runs the same
        collectives, none waits), frozen flats gathered for backward are freed."""
        self._callback_queued = False
        pending, self._pending = self._pending, []
        for f in pending:
            f.reduce_grad(None)
        for f in self._flats():
            f.free()

    def _weight(self) -> float | None:
        if self.local_batch_size is None:
            return 1.0 / self.comm.world_size
        return self.local_batch_size / self.global_batch_size if self.local_batch_size else None

    def set_local_batch_size(self, n: int) -> None:
        """Weight this rank's gradient by ``n`` / (sum of every rank's ``n``); a collective, as in DDP."""
        ok = type(n) is int and n >= 0  # a bad n is counted, so that every rank raises, none hangs
        buf, counts = flat_buffer(self.comm, 2, torch.int64, self.device)
        counts.copy_(torch.tensor([n if ok else 0, 0 if ok else 1]))
        allreduce(self.comm, buf, "ring")
        total, bad = (int(v) for v in counts.cpu())
        if bad or not total:
            raise ConfigError(f"local_batch_size must be an integer >= 0 on every rank, not 0 on all; "
                              f"this rank passed {n!r}, {bad} rank(s) passed no integer >= 0")
        self.local_batch_size, self.global_batch_size = n, total

    # -- full parameters ---------------------------------------------------------------------------
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
                    for mod, name in holders:
                        setattr(mod, name, full[s].view(shape))
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

    # -- memory ------------------------------------------------------------------------------------
    def param_memory(self) -> dict[str, int]:
        """Bytes of parameter storage on this rank: the shards, the most gathered (full) parameter
        storage alive at once (units in flight, a transient fp32 copy in mixed precision), their
        sum, and the unsharded model's parameters for scale."""
        flats = self._flats()
        shard = sum(f.shard.numel() * f.shard.element_size() for f in flats)
        return {"shard_bytes": shard, "gathered_peak_bytes": self.meter.peak,
                "peak_bytes": shard + self.meter.peak,
                "unsharded_bytes": sum(f.n * f.shard.element_size() for f in flats)}

    def reset_peak_memory(self) -> None:
        self.meter.reset_peak()


FSDP = FullyShardedDataParallel

