"""ZeRO stage 1: every rank keeps the optimizer state of only its 1/p of the parameters.

    from dplab.backends.nn.ddp import broadcast_module
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    def train(comm):
        model = Net()
        broadcast_module(model, comm)                 # replicas must start equal
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, comm, lr=1e-3)
        for x, y in my_shard_of_each_batch:
            opt.zero_grad()
            loss_fn(model(x), y).backward()           # a plain module: no DDP wrapper
            opt.step()                                # the same parameters on every rank after it

Adam keeps two numbers per parameter, twice the memory of the model itself, and plain
data parallelism keeps all of it on every rank. ZeRO (Rajbhandari et al., 2020) notices
that each rank only needs the state of the parameters it updates, and that an all-reduce
is a reduce-scatter followed by an all-gather: put the optimizer step in between.

    flat grad:   [ g0 | g1 | g2 | g3 ]   reduce_scatter: rank r holds the sum of shard r
    rank r:           step(shard r)      the inner optimizer sees one flat tensor: shard r
    flat param:  [ p0 | p1 | p2 | p3 ]   all_gather: every rank gets every updated shard

The same bytes move as in the all-reduce of data parallelism; the optimizer state and
its arithmetic shrink to 1/p. Shard r is ``chunk_bounds(n, p)[r]``, the chunk a ring
reduce-scatter leaves on rank r, so any n works, also n < p (some shards are empty).

Copies per step: none. The module's parameters and gradients become views into two flat
buffers (like FSDP's flat parameter), the shard the inner optimizer steps is a view of
the parameter buffer, and both collectives run in place. A gradient that autograd made
afresh (``param.grad`` was None: the first backward, or ``module.zero_grad()``) is copied
into its slot once at ``step()``. After ``step()`` the flat gradient outside this rank's
shard is reduce-scatter scratch: call ``zero_grad()`` before the next backward, as every
training loop does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from dplab.backends.nn.ddp import dtype_and_device, flat_buffer, flat_layout
from dplab.reference.collectives import allgather, reduce_scatter
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds

__all__ = ["ZeroRedundancyOptimizer"]

SCATTER_ALGORITHMS = ("ring", "direct")  # the ones with a reduce_scatter / allgather schedule


class ZeroRedundancyOptimizer:
    """Wraps ``optimizer_class`` so that each rank builds it over its own shard only."""

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                 comm: Communicator, algorithm: str = "ring", **optimizer_kwargs: Any) -> None:
        if algorithm not in SCATTER_ALGORITHMS:
            raise ConfigError(f"ZeRO needs a reduce-scatter and an all-gather: algorithm must be one of "
                              f"{', '.join(SCATTER_ALGORITHMS)}, got {algorithm!r}")
        self.comm, self.algorithm = comm, algorithm
        self.params = _trainable(params)
        dtype, device = dtype_and_device(self.params)
        slices = flat_layout(self.params)
        n = slices[-1].stop if slices else 0
        self._grad_buf, self.flat_grad = flat_buffer(comm, n, dtype, device)
        self._param_buf, self.flat_param = flat_buffer(comm, n, dtype, device)
        self.grad_slots = [self.flat_grad[s].view_as(p) for s, p in zip(slices, self.params)]
        with torch.no_grad():
            for p, s in zip(self.params, slices):
                self.flat_param[s].copy_(p.reshape(-1))
                p.data = self.flat_param[s].view_as(p)  # the module now reads the flat buffer
        self.zero_grad()
        self.shard_bounds = chunk_bounds(n, comm.world_size)[comm.rank]
        self.shard = self.flat_param[slice(*self.shard_bounds)]  # a leaf view: steps write through
        self.shard.grad = self.flat_grad[slice(*self.shard_bounds)]
        self.optim = optimizer_class([self.shard], **optimizer_kwargs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (set ``lr`` here, or schedule ``self.optim``)."""
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient in place and point every ``param.grad`` at its slot.

        ``set_to_none=True`` drops the gradients as torch optimizers do by default; it
        costs one copy per parameter at the next ``step()``, so it is not the default here.
        """
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.flat_grad.zero_()
        for p, slot in zip(self.params, self.grad_slots):
            p.grad = slot

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients, step this rank's shard, share the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.collect_grads()
        reduce_scatter(self.comm, self._grad_buf, self.algorithm)
        self.shard.grad.div_(self.comm.world_size)  # the sum of shard r, averaged
        self.optim.step()
        allgather(self.comm, self._param_buf, self.algorithm)
        return loss

    def collect_grads(self) -> None:
        """Make every ``param.grad`` its slot again; a missing gradient counts as zero.

        Zero is what a rank that never used a parameter contributes to the average. (A
        torch optimizer would skip such a parameter; here its shard steps anyway, so
        Adam's momentum and weight decay still move it.)
        """
        for p, slot in zip(self.params, self.grad_slots):
            if p.grad is not slot:
                if p.grad is None:
                    slot.zero_()
                else:
                    slot.copy_(p.grad)
                p.grad = slot

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard only: its entry 0 is the flat shard ``shard_bounds`` of the parameters."""
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the tensors in this rank's optimizer state (about 1/p of the unsharded)."""
        return sum(v.numel() * v.element_size() for s in self.optim.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))


def _trainable(params: Iterable[Any]) -> list[torch.Tensor]:
    """Parameters that require grad, each once (tied weights appear once)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in params:
        if isinstance(p, dict):
            raise ConfigError("parameter groups are not supported: pass one iterable of parameters "
                              "(the inner optimizer gets one flat shard, so one group)")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
