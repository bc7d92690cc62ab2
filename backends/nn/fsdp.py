"""Fully sharded data parallelism (ZeRO stage 3) for torch modules, over our collectives.

    fsdp = FSDP(model, comm, units=list(model.blocks))   # rank 0's weights, then sharded
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # "blocks.0.weight"...: this rank's pieces
    loss_fn(fsdp(x), y).backward()    # gathers each unit before its forward and backward
    fsdp.clip_grad_norm_(1.0)         # the global norm, as torch's FSDP.clip_grad_norm_
    opt.step()
    fsdp.full_state_dict()            # every rank: the plain module's state dict
    with fsdp.summon_full_params():   # full parameters as attributes, written back at exit
        fsdp.module.head.weight.mul_(2)

Each unit (a listed submodule; the root holds every other parameter) keeps its parameters as one
flat tensor of which rank r stores ``chunk_bounds(n, p)[r]``; its full parameters exist only while
it runs:

    forward,  unit k:  all-gather flat k -> run unit k -> free flat k
    backward, unit k:  all-gather flat k -> unit k's backward -> reduce-scatter grad k -> free both

Gradients are averaged as DDP's (sum / p, or by ``local_batch_size``); ``no_sync()`` reduce-scatters
once per unit per step; the dtypes are torch's MixedPrecision; prefetch changes no bit
(nn/README.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from dplab.backends.fastpath.executor import allgather
from dplab.backends.nn.ddp import broadcast_module
from dplab.backends.nn.flat import dtype_and_device, flat_buffer, sum_batch_sizes
from dplab.backends.nn.fsdp_flat import FlatParam, MemoryMeter, show
from dplab.backends.nn.fsdp_policy import (
    MixedPrecision,
    Policy,
    cast_kept_modules,
    cast_unit_inputs,
    is_kept,
    unit_precisions,
)
from dplab.backends.nn.fsdp_precision import (
    COMPUTE_DTYPES,
    cast_buffers,
    cast_floats,
    restore_buffers,
    tensors_in,
)
from dplab.backends.nn.fsdp_prefetch import CommRunner, Gathers, UnitOrder, backward_pre
from dplab.backends.nn.fsdp_units import param_keys, plan_units
from dplab.reference.algorithms import SCATTER_ALGORITHMS, has_schedule
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError

__all__ = ["FullyShardedDataParallel", "FSDP", "COMPUTE_DTYPES", "MixedPrecision"]



class FullyShardedDataParallel(nn.Module):
    """Wraps ``module``: its parameters become flat shards, gathered per unit while it runs.

    Args:
        module: the module to wrap; every rank's copy is given rank 0's parameters and buffers.
        comm: this rank's communicator (any backend; tensors on a GPU need one that moves them).
        units: submodules that each get their own flat parameter (none may contain another);
            ``None``: the whole model is one unit. Their order is the order of ``parameters()``.
        compute_dtype: dtype of the gather, forward and backward (float16, bfloat16); masters and
            optimizer stay in the module's dtype. ``None``: the module's dtype.
        reduce_dtype: dtype of the gradients' reduce-scatter. ``None``: the module's dtype.
            (These two are the short form of ``mixed_precision=MixedPrecision(compute_dtype,
            reduce_dtype, buffer_dtype=compute_dtype)``.)
        mixed_precision: a ``MixedPrecision`` for every unit, or a mapping unit -> policy
            (``fsdp_policy``); units left out run in the module's dtype.
        keep_float32: module classes (``nn.LayerNorm``) whose parameters and buffers stay in the
            module's dtype in every unit; they compute in it and hand their unit's dtype on.
        forward_prefetch: gather the next unit (the previous forward's order) while one computes.
        backward_prefetch: ``"BACKWARD_PRE"`` (or torch's enum): gather the unit whose backward is
            next while one's backward runs. Either puts FSDP's collectives on a comm thread
            (``fsdp_prefetch``); the results are bitwise the same.
        algorithm: ``ring`` or ``direct`` (the schedules with a reduce-scatter and all-gather).
        local_batch_size: this rank's shard size, for uneven shards (as in ``DDP``).

    Raises:
        ConfigError: an algorithm without a reduce-scatter, units that are not submodules or
            overlap, both ``mixed_precision`` and ``compute_dtype``/``reduce_dtype``, a dtype or
            policy FSDP does not take, an unknown ``backward_prefetch``, or parameters on a
            device the communicator does not move.
    """

    def __init__(self, module: nn.Module, comm: Communicator, *,
                 units: Sequence[nn.Module] | None = None,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 mixed_precision: Policy = None, keep_float32: tuple[type, ...] = (),
                 forward_prefetch: bool = False, backward_prefetch: Any = None,
                 algorithm: str = "ring", local_batch_size: int | None = None) -> None:
        super().__init__()
        if not has_schedule(algorithm, "scatter"):
            raise ConfigError("FSDP needs a reduce-scatter and an all-gather: algorithm must "
                              f"be one of {', '.join(SCATTER_ALGORITHMS)}, got {algorithm!r}")
        plans = plan_units(module, units)  # checked before any collective: a bad unit fails alone
        self.forward_prefetch = bool(forward_prefetch)
        self.backward_prefetch = backward_pre(backward_prefetch)
        master, device = dtype_and_device(list(module.parameters()))
        if mixed_precision is not None and (compute_dtype or reduce_dtype):
            raise ConfigError("give either mixed_precision or compute_dtype/reduce_dtype, not both")
        # the short form: one policy
        if mixed_precision is None and (compute_dtype or reduce_dtype):
            mixed_precision = MixedPrecision(compute_dtype, reduce_dtype, compute_dtype)
        self.precisions = unit_precisions(mixed_precision, [q.module for q in plans], master, comm,
                                          device)
        self.compute_dtype = self.precisions[0].compute
        self.reduce_dtype = self.precisions[0].reduce
        self.keep_float32 = tuple(keep_float32)
        if device.type != "cpu":
            # raises unless the communicator moves that device's memory
            flat_buffer(comm, 0, master, device)
        self.module, self.comm, self.algorithm, self.device = module, comm, algorithm, device
        broadcast_module(module, comm)
        self._state_keys = list(module.state_dict().keys())
        self._param_keys = param_keys(module)
        self._buffer_dtypes = {k: module.get_buffer(k).dtype for k in self._state_keys
                               if k not in self._param_keys}
        self.meter = MemoryMeter()
        self.unit_names = [q.name for q in plans]
        self._build_flats(plans, master)
        unit_of = {id(m): k for k, q in enumerate(plans) if k for m in q.module.modules()}
        self._float_buffers = [(mod, name, dtype) for mod in module.modules()
                               if (dtype := self._buffer_dtype(mod, unit_of)) is not None
                               for name, b in mod._buffers.items() if b is not None
                               and b.is_floating_point()]
        mixed = any(u.compute is not None for u in self.precisions)
        self._input_dtypes = [u.compute or master for u in self.precisions] if mixed else None
        cast_kept_modules(module, self.keep_float32, unit_of, self.precisions, master)
        runner = CommRunner(threaded=self.forward_prefetch or self.backward_prefetch)
        self._gathers, self._order = Gathers(self.units, runner, comm.tracer), UnitOrder()
        self._register_hooks(plans)
        self._pending: list[FlatParam] = []  # trainable flats used in forward, not reduced yet
        self._reduced: list[FlatParam] = []  # flats whose reduction this backward submitted
        self._callback_queued = False
        self._summoned = False
        self.require_backward_grad_sync = True  # toggled by no_sync(), read by forward()
        self._sync_this_backward = True
        self.local_batch_size: int | None = None
        self.global_batch_size: int | None = None
        if local_batch_size is not None:
            self.set_local_batch_size(local_batch_size)

    def _build_flats(self, plans: list, master: torch.dtype) -> None:
        """Per unit, a flat per (trainable, kept in float32) group of its parameters: a flat has one
        gather dtype and one reduce dtype."""
        first_key: dict[int, str] = {}
        for key, pid in self._param_keys.items():
            first_key.setdefault(pid, key)
        self.units: list[list[FlatParam]] = []
        # per flat: the state-dict key of each of its parameters
        self._flat_keys: list[list[str]] = []
        for plan, prec in zip(plans, self.precisions):
            flats = []
            for trainable, kept in ((True, False), (True, True), (False, False), (False, True)):
                idx = [i for i, q in enumerate(plan.params) if q.requires_grad == trainable
                       and is_kept(plan.holders[i], self.keep_float32) == kept]
                if idx:
                    gather, reduce = (master, master) if kept else (prec.compute or master,
                                                                    prec.reduce)
                    params, holders = [plan.params[i] for i in idx], [plan.holders[i] for i in idx]
                    flats.append(FlatParam(self.comm, params, holders, gather, trainable,
                                           self.meter, self.algorithm, reduce))
                    self._flat_keys.append([first_key[id(plan.params[i])] for i in idx])
            self.units.append(flats)

    def _buffer_dtype(self, mod: nn.Module, unit_of: dict[int, int]) -> torch.dtype | None:
        """The dtype ``mod``'s floating buffers are cast to per forward: its unit's
        ``buffer_dtype``, none for a kept (float32) module."""
        if self.keep_float32 and isinstance(mod, self.keep_float32):
            return None
        return self.precisions[unit_of.get(id(mod), 0)].buffer

    def _register_hooks(self, plans: list) -> None:
        for k, flats in enumerate(self.units):
            for f in flats:
                if f.trainable:
                    f.leaf.register_post_accumulate_grad_hook(partial(self._grad_ready, k, f))
            if k:
                if self._input_dtypes is not None:
                    cast = partial(cast_unit_inputs, self._input_dtypes[k])
                    plans[k].module.register_forward_pre_hook(cast, with_kwargs=True)
                plans[k].module.register_forward_pre_hook(partial(self._pre_forward, k))
                plans[k].module.register_forward_hook(partial(self._post_forward, k))

    def _flats(self) -> list[FlatParam]:
        return [f for flats in self.units for f in flats]

    # -- forward and backward ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with its root unit gathered; each listed unit gathers itself.

        Args:
            *args: the wrapped module's positional arguments (floats cast to the root unit's
                compute dtype, if it has one).
            **kwargs: its keyword arguments (likewise).

        Returns:
            The wrapped module's output.

        Raises:
            ConfigError: called inside ``summon_full_params()``.
        """
        if self._summoned:
            raise ConfigError("forward inside summon_full_params(): leave the context first")
        # a forward whose backward never ran (evaluation) leaves nothing behind
        self._pending.clear()
        self._sync_this_backward = self.require_backward_grad_sync
        self._order.start_forward()
        if self._input_dtypes is not None:
            args, kwargs = cast_floats((args, kwargs), self._input_dtypes[0])
        self._pre_forward(0)
        masters = cast_buffers(self._float_buffers)
        try:
            output = self.module(*args, **kwargs)
        finally:
            restore_buffers(self._float_buffers, masters)
        output = self._post_forward(0, None, None, output)
        for f in self._flats():  # a prefetch whose unit did not run: never keep stale parameters
            self._gathers.free(f)
        return output

    def _pre_forward(self, k: int, *_: Any) -> None:
        self._gathers.gather(k)
        for f in self.units[k]:
            f.use_views()
            if f.trainable and torch.is_grad_enabled() and f not in self._pending:
                self._pending.append(f)
        nxt = self._order.forward_next(k)
        if self.forward_prefetch:
            self._gathers.prefetch(nxt)  # travels while unit k computes
        self._gathers.start("forward", k)

    def _post_forward(self, k: int, _module: Any, _args: Any, output: Any) -> Any:
        self._gathers.end("forward", k)
        for f in self.units[k]:
            self._gathers.free(f)
        if torch.is_grad_enabled() and self.units[k]:
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, k))
        return output

    def _pre_backward(self, k: int, _grad: torch.Tensor) -> None:
        """The gradient of unit k's output exists: its backward is next, gather its parameters
        (and, with BACKWARD_PRE, start gathering the unit whose backward follows)."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._gathers.gather(k)
        if self.backward_prefetch:
            self._gathers.prefetch(self._order.backward_next(k))
        self._gathers.start("backward", k)

    def _grad_ready(self, k: int, flat: FlatParam, _leaf: torch.Tensor) -> None:
        """Autograd's word that the flat's full gradient is complete: reduce-scatter it (or, under
        no_sync, keep it), free the parameters."""
        self._gathers.end("backward", k)
        if self._sync_this_backward:
            # with prefetch, on the comm thread: overlaps too
            self._gathers.reduce(flat, self._weight())
            self._reduced.append(flat)
        else:
            flat.hold_grad()
        self._gathers.free(flat)
        if flat in self._pending:
            self._pending.remove(flat)

    def _end_backward(self) -> None:
        """After a synced backward: flats that got no gradient reduce what they hold from no_sync,
        or zeros (every rank runs the same collectives, none waits). Every job is waited for, so
        the gradients are in place when backward returns; gathered flats are freed."""
        self._callback_queued = False
        pending, self._pending = self._pending, []
        reduced, self._reduced = self._reduced, []
        # not f.held alone: a reduction on the comm thread may not have run yet
        if self._sync_this_backward:
            held = [f for f in self._flats() if f.held is not None and f not in pending
                    and f not in reduced]
            for f in pending + held:
                self._gathers.reduce(f, self._weight())
        self._gathers.drain()
        for f in self._flats():
            f.free()

    def _weight(self) -> float | None:
        if self.local_batch_size is None:
            return 1.0 / self.comm.world_size
        return self.local_batch_size / self.global_batch_size if self.local_batch_size else None

    def set_local_batch_size(self, n: int) -> None:
        """Weight this rank's gradient by ``n`` / (sum of every rank's ``n``); a collective, as in
        DDP.

        Args:
            n: this rank's samples in the step (all micro-batches), >= 0.
        """
        total = sum_batch_sizes(self.comm, n, flat_buffer(self.comm, 2, torch.int64, self.device))
        self.local_batch_size, self.global_batch_size = n, total

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication: backwards of forwards run in here keep each
        unit's full gradient; the next synced backward reduce-scatters the sum, once per unit.
        So k micro-batches in here and one outside (each loss scaled to the step's batch) take
        the big batch's step with one reduce-scatter per unit instead of k + 1. The weight
        (``local_batch_size``) applies once, to the sum: count the samples of all micro-batches.
        ``zero_grad`` does not clear what is held (it is not in the shards' ``.grad`` yet).

        Yields:
            None; on leaving the block, syncing is back to what it was.
        """
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- memory ------------------------------------------------------------------------------------
    def param_memory(self) -> dict[str, int]:
        """Bytes of parameter storage on this rank: the shards, the most gathered (full) parameter
        storage alive at once (units in flight, in the compute dtype), their sum, the unsharded
        model's parameters for scale, and the full gradients no_sync holds now.

        Returns:
            ``{shard_bytes, gathered_peak_bytes, peak_bytes, unsharded_bytes, held_grad_bytes}``.
        """
        flats = self._flats()
        shard = sum(f.shard.numel() * f.shard.element_size() for f in flats)
        return {"shard_bytes": shard, "gathered_peak_bytes": self.meter.peak,
                "peak_bytes": shard + self.meter.peak,
                "unsharded_bytes": sum(f.n * f.shard.element_size() for f in flats),
                "held_grad_bytes": sum(f.held.nbytes for f in flats if f.held is not None)}

    def reset_peak_memory(self) -> None:
        self.meter.reset_peak()

    # -- full parameters: summoned into the module for a while, or as a plain state dict --------
    @contextmanager
    def summon_full_params(self, writeback: bool = True,
                           with_grads: bool = False) -> Iterator[None]:
        """Inside, the module's attributes are the full parameters in the master dtype, on every
        rank; with ``writeback`` each rank's chunk of what they hold at exit goes back to its shard.
        With ``with_grads`` (torch's name) each one's ``.grad`` is its full gradient, the same on
        every rank (a copy: nothing goes back). A collective: call it on every rank, outside
        forward and backward.

        A parameter's own ``.grad`` outside is this rank's piece, of another size on each rank
        (maybe empty): a torch collective over it, as over a DDP replica's, hangs. Compare or
        gather full gradients in here.

        Args:
            writeback: at exit, each rank's chunk of the full parameters goes back to its shard.
            with_grads: give each full parameter its full gradient as ``.grad``.

        Yields:
            None, while the module holds its full parameters.

        Raises:
            ConfigError: called inside forward, backward or another summon.
        """
        if self._summoned or any(f.gathered for f in self._flats()):
            raise ConfigError("summon_full_params() inside forward, backward or another summon: "
                              "call it between steps")
        fulls = []
        try:
            for flat in self._flats():
                full = flat.full_master()
                fulls.append(full)
                grad = flat.full_grad() if with_grads and flat.trainable else None
                for s, shape, holders in zip(flat.slices, flat.shapes, flat.holders):
                    view = full[s].view(shape)
                    if grad is not None:
                        view.grad = grad[s].view(shape)
                    show(holders, view)
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
        """The wrapped module's ``state_dict()`` as if it were never wrapped, the same on every
        rank: full parameters in the master dtype, buffers in their original dtype. A collective.

        Returns:
            Every key of the plain module's ``state_dict()``, each a tensor of its own.
        """
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
        the same dict on every rank).

        Args:
            state_dict: the plain module's state dict (every key, full tensors).

        Raises:
            ConfigError: keys missing or unexpected, naming them.
        """
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if missing or unexpected:
            raise ConfigError(f"state dict does not fit the wrapped module: missing {missing}, "
                              f"unexpected {unexpected}")
        for flat, keys in zip(self._flats(), self._flat_keys):
            flat.load_full(torch.cat([state_dict[k].reshape(-1).to(flat.master_dtype)
                                      for k in keys]))
        with torch.no_grad():
            for key in self._buffer_dtypes:
                buf = self.module.get_buffer(key)
                buf.copy_(state_dict[key].to(buf.dtype))

    # -- the parameters as torch code sees them: original names, sharded values, a global clip -
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under its own names ("0.weight", not "module.0.weight"),
        each this rank's piece of it. ``parameters()`` yields the same tensors.

        Args:
            prefix: prepended to every name.
            recurse: include submodules' parameters.
            remove_duplicate: tied parameters once.

        Returns:
            An iterator of (name, parameter).
        """
        return self.module.named_parameters(prefix=prefix, recurse=recurse,
                                            remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The plain module's state dict (full values, original keys), as torch's FSDP1 gives by
        default (FULL_STATE_DICT): ``full_state_dict()``, a collective.

        Args:
            *args: unused (torch's positional form).
            destination: a dict to fill instead of a new ``OrderedDict``.
            prefix: prepended to every key.
            keep_vars: unused: the values are detached copies.

        Returns:
            ``destination``, or a new ``OrderedDict``, with every key.
        """
        out = OrderedDict() if destination is None else destination
        for key, value in self.full_state_dict().items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a plain module's state dict (``load_full_state_dict``: every key, no communication).

        Args:
            state_dict: the plain module's state dict.
            strict: unused: every key must fit, always.
            assign: unused: values are copied into the shards.

        Returns:
            torch's ``_IncompatibleKeys``, always empty.

        Raises:
            ConfigError: keys missing or unexpected.
        """
        self.load_full_state_dict(dict(state_dict))
        return nn.modules.module._IncompatibleKeys([], [])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every rank's gradient pieces so that the *global* norm is at most ``max_norm``;
        returns the global norm (the same on every rank). A collective: call it on every rank.

        Args:
            max_norm: the largest global norm allowed.
            norm_type: the p of the p-norm (``inf`` too).

        Returns:
            The global norm before clipping, in the gradients' dtype.
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        dtype = grads[0].dtype if grads else torch.float64
        # an empty piece has no inf-norm in torch
        local = torch.nn.utils.get_total_norm([g for g in grads if g.numel()],
                                              norm_type).to(torch.float64)
        total = _combine(self.comm, local, float(norm_type), self.algorithm, self.device).to(dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def _combine(comm: Communicator, local: torch.Tensor, norm_type: float, algorithm: str,
             device: torch.device) -> torch.Tensor:
    """The norm of every rank's ``local`` norm (one all-gather of a value per rank)."""
    buf, norms = flat_buffer(comm, comm.world_size, torch.float64, device)
    norms.zero_()
    norms[comm.rank] = local
    allgather(comm, buf, algorithm)
    return torch.linalg.vector_norm(norms.clone(), norm_type)


FSDP = FullyShardedDataParallel
