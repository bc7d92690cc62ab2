"""ZeRO stage 1: every rank keeps the optimizer state of only its 1/p of the parameters.

    broadcast_module(model, comm)                 # replicas must start equal (nn.ddp)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, comm, lr=1e-3)
    loss_fn(model(x), y).backward()               # a plain module: no DDP wrapper
    opt.step()                                    # the same parameters on every rank after it
    opt.consolidate_state_dict(to=0)              # then rank 0's opt.state_dict(): torch.optim's

    flat grad:   [ g0 | g1 | g2 | g3 ]   reduce_scatter: rank r holds the sum of shard r
    rank r:           step(shard r)      the inner optimizer sees one flat tensor: shard r
    flat param:  [ p0 | p1 | p2 | p3 ]   all_gather: every rank gets every updated shard

A ``torch.optim.Optimizer`` (param groups, LR schedulers, ``add_param_group`` on every rank), exact
for element-wise optimizers (SGD, Adam, AdamW, ...), not LAMB, Adafactor or LBFGS. Shard r is
``chunk_bounds(n, p)[r]`` (any n; shards may be empty). Call ``zero_grad()`` before each backward:
after ``step()`` the gradient outside this rank's shard is scratch. A parameter belongs to one ZeRO
at a time: a later one over it takes it over, and the earlier one's ``step()`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dplab.backends.fastpath.executor import allgather, reduce_scatter
from dplab.backends.nn.flat import dtype_and_device, flat_buffer, flat_layout
from dplab.backends.nn.zero_state import full_state_dict, gather_state, load_full_state
from dplab.reference.algorithms import SCATTER_ALGORITHMS, has_schedule
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds

__all__ = ["ZeroRedundancyOptimizer", "FlatGroup"]

NOT_OPTIONS = ("params", "param_names")  # group keys that are not the optimizer's options


class FlatGroup:
    """One parameter group's trainable parameters as two flat buffers, and this rank's shard.

    Args:
        comm: this rank's communicator (the buffers are its ``flat_buffer``).
        params: the group's tensors; those that require grad are flattened (tied ones once), and
            the module reads them from the flat buffer from then on.
    """

    def __init__(self, comm: Communicator, params: Iterable[torch.Tensor]) -> None:
        self.params = _trainable(params)
        dtype, device = dtype_and_device(self.params)
        self.slices = flat_layout(self.params)
        self.n = self.slices[-1].stop if self.slices else 0
        self.grad_buf, self.flat_grad = flat_buffer(comm, self.n, dtype, device)
        self.param_buf, self.flat_param = flat_buffer(comm, self.n, dtype, device)
        self.grad_slots = [self.flat_grad[s].view_as(p) for s, p in zip(self.slices, self.params)]
        with torch.no_grad():
            for p, s in zip(self.params, self.slices):
                self.flat_param[s].copy_(p.reshape(-1))
                p.data = self.flat_param[s].view_as(p)  # the module now reads the flat buffer
        self.addresses = [p.data_ptr() for p in self.params]  # where the module reads each one now
        self.zero_grad()
        self.bounds = chunk_bounds(self.n, comm.world_size)[comm.rank]
        self.shard = self.flat_param[slice(*self.bounds)]  # a leaf view: steps write through
        self.shard.grad = self.flat_grad[slice(*self.bounds)]

    def moved(self) -> int | None:
        """The index of the first parameter the module no longer reads from this group's flat
        buffer (another ZeRO took it over, or its ``.data`` was replaced), or None.

        Returns:
            That parameter's index in ``params``, or None when all are where this group put them.
        """
        for i, (p, address) in enumerate(zip(self.params, self.addresses)):
            if p.data_ptr() != address:
                return i
        return None

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        for p, slot in zip(self.params, self.grad_slots):
            p.grad = slot

    def collect_grads(self) -> None:
        """Make every ``param.grad`` its slot again; a missing gradient counts as zero."""
        for p, slot in zip(self.params, self.grad_slots):
            if p.grad is not slot:
                if p.grad is None:
                    slot.zero_()
                else:
                    slot.copy_(p.grad)
                p.grad = slot


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank builds it over its own shards only.

    Args:
        params: as for any torch optimizer: an iterable of tensors or of parameter-group dicts
            (``{"params": ..., "lr": ...}``).
        optimizer_class: the torch optimizer each rank builds over its shards
            (``torch.optim.AdamW``).
        comm: this rank's communicator.
        algorithm: the reduce-scatter and all-gather's schedule.
        **optimizer_kwargs: the defaults of every group (``lr=...``), passed to ``optimizer_class``.

    Raises:
        ConfigError: ``algorithm`` has no reduce-scatter and all-gather.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 comm: Communicator, algorithm: str = "ring", **optimizer_kwargs: Any) -> None:
        if not has_schedule(algorithm, "scatter"):
            raise ConfigError("ZeRO needs a reduce-scatter and an all-gather: algorithm must "
                              f"be one of {', '.join(SCATTER_ALGORITHMS)}, got {algorithm!r}")
        self.comm, self.algorithm, self.optimizer_class = comm, algorithm, optimizer_class
        self.groups: list[FlatGroup] = []  # one per param_groups entry, same order
        self.optim: torch.optim.Optimizer | None = None
        self._consolidated: dict[str, Any] | None = None
        super().__init__(params, optimizer_kwargs)  # calls add_param_group for each group
        self.optim = optimizer_class([_inner(g, f) for g, f in zip(self.param_groups, self.groups)],
                                     **optimizer_kwargs)
        _copy_options(self.optim.param_groups, self.param_groups)  # the class's defaults, shown

    @property
    def shard_bounds(self) -> tuple[int, int]:
        """This rank's shard of the first group's flat buffer (``groups[i].bounds`` for others)."""
        return self.groups[0].bounds

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (say, layers unfrozen while fine-tuning). Call it on every rank: the
        group is flattened and sharded like the others; no existing state moves.

        Args:
            param_group: ``{"params": tensors, **options}``, as ``torch.optim`` takes it.
        """
        super().add_param_group(param_group)
        self.groups.append(FlatGroup(self.comm, self.param_groups[-1]["params"]))
        if self.optim is not None:
            self.optim.add_param_group(_inner(self.param_groups[-1], self.groups[-1]))
            _copy_options(self.optim.param_groups[-1:], self.param_groups[-1:])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradients in place and point every ``param.grad`` at its slot.

        ``set_to_none=True`` drops the gradients as torch optimizers do by default; it
        costs one copy per parameter at the next ``step()``, so it is not the default here.

        Args:
            set_to_none: drop the gradients instead of zeroing them.
        """
        if set_to_none:
            for g in self.groups:
                for p in g.params:
                    p.grad = None
            return
        for g in self.groups:
            g.zero_grad()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients, step this rank's shards, share the updated parameters.

        A parameter without a gradient counts as a zero gradient (what a rank that never used
        it contributes), so, unlike a torch optimizer, its shard still steps: Adam's momentum
        and weight decay still move it.

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.

        Returns:
            The closure's loss, or None without one.

        Raises:
            ConfigError: a later ``ZeroRedundancyOptimizer`` took over some of these parameters
                (the module then reads that one's flat buffer, and this step would move nothing):
                building a new optimizer over a model works, stepping the old one does not.
        """
        self._check_owner()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None  # the state moves on: consolidate again before saving
        for g in self.groups:
            g.collect_grads()
            reduce_scatter(self.comm, g.grad_buf, self.algorithm)
            g.shard.grad.div_(self.comm.world_size)  # the sum of shard r, averaged
        _copy_options(self.param_groups, self.optim.param_groups)  # a scheduler's new lr
        self.optim.step()
        for g in self.groups:
            allgather(self.comm, g.param_buf, self.algorithm)
        return loss

    def collect_grads(self) -> None:
        for g in self.groups:
            g.collect_grads()

    def _check_owner(self) -> None:
        for k, g in enumerate(self.groups):
            i = g.moved()
            if i is not None:
                raise ConfigError(
                    f"parameter {i} of group {k} ({tuple(g.params[i].shape)}) was taken over by a "
                    "ZeroRedundancyOptimizer built later over the same parameters (or its "
                    ".data was replaced, as module.to() does), so this one's step would "
                    "move nothing: step only the newest optimizer (add_param_group gives "
                    "one optimizer more parameters)")

    # -- state -----------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shards of the optimizer state onto rank ``to``, as torch's ZeRO
        does: a collective, call it on every rank, after the last ``step()`` to be saved.

        Args:
            to: the rank that ends holding the state (its ``state_dict()``).

        Raises:
            ConfigError: ``to`` is not a rank of the world.
        """
        if type(to) is not int or not 0 <= to < self.comm.world_size:
            raise ConfigError(f"to must be a rank in 0..{self.comm.world_size - 1}, got {to!r}")
        gathered = gather_state(self)
        self._consolidated = full_state_dict(self, gathered) if self.comm.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's state dict (``torch.optim`` format: state per parameter
        index), on the rank that ``consolidate_state_dict`` gathered to since the last step.

        Returns:
            ``{"state": ..., "param_groups": ...}``, as the unsharded optimizer's.

        Raises:
            ConfigError: this rank holds no state consolidated since the last step.
        """
        if self._consolidated is None:
            raise ConfigError(f"rank {self.comm.rank} holds no consolidated state: call "
                              f"consolidate_state_dict(to={self.comm.rank}) on every rank "
                              "after the last step() (or use local_state_dict() for this "
                              "rank's shards)")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded state dict (from ``state_dict()``, or from the ``torch.optim``
        optimizer of the same class over the same parameter groups): each rank keeps its shards.

        Args:
            state_dict: ``{"state": ..., "param_groups": ...}`` in ``torch.optim``'s format.

        Raises:
            ConfigError: its groups do not match these (sizes), or a group's state is partial.
        """
        load_full_state(self, state_dict)
        _copy_options(self.param_groups, self.optim.param_groups)
        self._consolidated = None

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shards only (no communication): entry i is group i's flat shard.

        Returns:
            The inner optimizer's state dict.
        """
        return self.optim.state_dict()

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's shards, as ``local_state_dict`` returned them (no communication).

        Args:
            state: the inner optimizer's state dict, from this rank with the same world size.
        """
        self.optim.load_state_dict(state)
        _copy_options(self.optim.param_groups, self.param_groups)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the tensors in this rank's optimizer state (about 1/p of the unsharded).

        Returns:
            The bytes, summed over this rank's state tensors.
        """
        return sum(v.numel() * v.element_size() for s in self.optim.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))


def _inner(group: dict[str, Any], flat: FlatGroup) -> dict[str, Any]:
    """The inner optimizer's group: this rank's shard, with the outer group's options."""
    return {**{k: v for k, v in group.items() if k not in NOT_OPTIONS}, "params": [flat.shard]}


def _copy_options(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    for a, b in zip(src, dst):
        b.update({k: v for k, v in a.items() if k not in NOT_OPTIONS})


def _trainable(params: Iterable[Any]) -> list[torch.Tensor]:
    """Parameters that require grad, each once (tied weights appear once)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
