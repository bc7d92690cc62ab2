"""Data-parallel training of any torch module: torch's DistributedDataParallel, written small.

    def train(comm):
        model = DDP(Net(), comm, bucket_cap_mb=25)     # rank 0's weights everywhere
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in my_shard_of_each_batch:           # equal-size shards (else: local_batch_size=)
            opt.zero_grad()
            loss_fn(model(x), y).backward()            # buckets all-reduced while backward runs
            opt.step()                                 # the same averaged gradient on every rank
    launch(train, 4)                                   # backend="mpi" or "torch" too

    flat grad:  [ emb | layer 1 | layer 2 | head ]   named_parameters() order; param.grad is a view
    buckets:    [   bucket 1    ][  bucket 0      ]  reverse: head's bucket goes first

Each complete bucket is all-reduced by the ``Reducer`` (``reference.train.buckets``) on a comm
thread; ``loss.backward()`` returns with every bucket reduced. The gradient is the mean over ranks
(sum / p); with uneven shards pass ``local_batch_size=len(my_shard)`` (or ``set_local_batch_size``)
and rank r counts n_r / N, as the reference trainer does (an empty shard contributes zeros).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from dplab.backends.fastpath.executor import allreduce, broadcast
from dplab.backends.nn.flat import dtype_and_device, flat_buffer, flat_layout, sum_batch_sizes
from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.train.buckets import Reducer

__all__ = ["DistributedDataParallel", "DDP", "broadcast_module", "DEFAULT_BUCKET_CAP_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0  # torch's DDP: bucket_cap_mb=None means this

_CARRIERS = (torch.float32, torch.float64, torch.int32, torch.int64)  # what the collectives move


@torch.no_grad()
def broadcast_module(module: nn.Module, comm: Communicator, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers (one broadcast per dtype).

    Tensors of a dtype the collectives do not move (bool, int8, float16, ...) travel in a
    wider one (int64, float64) and are converted back exactly.

    Args:
        module: its parameters and buffers are overwritten in place (on ``root``: sent).
        comm: this rank's communicator; a collective, so every rank calls it.
        root: the rank whose tensors every rank ends with.

    Raises:
        ConfigError: a complex tensor (the collectives move real numbers).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.is_complex():
            raise ConfigError(f"cannot broadcast a {t.dtype} tensor: collectives move real numbers")
        carrier = t.dtype if t.dtype in _CARRIERS else (
            torch.float64 if t.dtype.is_floating_point else torch.int64)
        groups.setdefault((carrier, t.device), []).append(t)
    for (carrier, device), tensors in groups.items():
        buf, flat = flat_buffer(comm, sum(t.numel() for t in tensors), carrier, device)
        slices = flat_layout(tensors)
        for t, s in zip(tensors, slices):
            flat[s].copy_(t.reshape(-1))
        broadcast(comm, buf, root=root)
        for t, s in zip(tensors, slices):
            t.copy_(flat[s].view_as(t))


def _grad_ready(ref: weakref.ref, i: int, param: torch.Tensor) -> None:
    """The hook holds the wrapper weakly: dropping the wrapper frees it (and its comm thread)."""
    ddp = ref()
    if ddp is not None:
        ddp.mark_param_as_ready(i, param)


def _release(reducer: Reducer, handles: list) -> None:
    for h in handles:
        h.remove()
    reducer.close()


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` so that backward averages its gradients over all ranks of ``comm``.

    Differences from torch's DDP, on purpose: buffers are broadcast once, at construction
    (no ``broadcast_buffers`` at every forward, so BatchNorm statistics stay per rank), and
    every trainable parameter must get a gradient in every synced backward (no
    ``find_unused_parameters``; ``wait`` says which one did not).

    Args:
        module: the module to wrap; every rank's copy is given rank 0's parameters and buffers.
        comm: this rank's communicator (any backend; torch tensors need one that moves them).
        bucket_cap_mb: MiB of gradients per all-reduce (a parameter is never split).
            ``None`` is torch's default, 25 MiB; ``math.inf`` puts every gradient in one bucket.
        algorithm: any all-reduce of the registry (``dplab.reference.algorithms``), ``native`` (the
            engine's own) or ``auto`` (the fitted cost model's choice per bucket).
        local_batch_size: this rank's shard size. Without it gradients are averaged over ranks
            (sum / p, as torch's DDP does), which weights uneven shards wrongly: a sample on a
            rank with a small shard counts more. With it each rank's gradient (of its mean loss)
            counts n_r / N, N the global batch: exactly the full batch's gradient. Costs one
            one-element all-reduce here and at each ``set_local_batch_size``, none per step.

    Raises:
        ConfigError: an unknown algorithm, or parameters the collectives cannot move.
    """

    def __init__(self, module: nn.Module, comm: Communicator, bucket_cap_mb: float | None = None,
                 algorithm: str = "ring", local_batch_size: int | None = None) -> None:
        super().__init__()
        if not has_schedule(algorithm):
            raise ConfigError(f"unknown algorithm {algorithm!r}: choose one of "
                              f"{', '.join(ALGORITHMS)}")
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
        self.module, self.comm, self.algorithm = module, comm, algorithm
        broadcast_module(module, comm)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]  # for error messages
        params = [p for _, p in named]  # named_parameters() already dedupes tied weights
        dtype, device = dtype_and_device(params)
        slices = flat_layout(params)
        buf, self.flat_grad = flat_buffer(comm, slices[-1].stop if slices else 0, dtype, device)
        self.flat_grad.zero_()
        self.grad_slots = [self.flat_grad[s].view_as(p) for s, p in zip(slices, params)]
        self.reducer = Reducer(comm, buf, slices, bucket_cap_mb, algorithm, allreduce=allreduce)
        self.require_backward_grad_sync = True  # toggled by no_sync(), read by forward()
        self._sync_this_backward = True
        self._pending = False  # a synced backward has started and wait() has not run yet
        self._unready = set(range(len(params)))
        self.local_batch_size: int | None = None  # None: average over ranks (equal shards)
        self.global_batch_size: int | None = None
        self._counts: tuple[Any, torch.Tensor] | None = None
        if local_batch_size is not None:
            self.set_local_batch_size(local_batch_size)
        ref = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(partial(_grad_ready, ref, i))
                   for i, p in enumerate(params)]
        self._finalizer = weakref.finalize(self, _release, self.reducer, handles)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; like DDP, whether its backward syncs is decided here, not in backward.

        Args:
            *args: the wrapped module's positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            The wrapped module's output.

        Raises:
            ConfigError: the previous synced backward raised before its end (its buckets were only
                partly reduced).
        """
        if self._pending:
            raise ConfigError("the previous synced backward did not finish (it raised before "
                              "its end), so its buckets were only partly reduced: build a new "
                              "DDP in a new world")
        self._sync_this_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    def set_local_batch_size(self, n: int) -> None:
        """Weight this rank's gradient by its shard, ``n`` / (sum of every rank's ``n``).

        A collective (one all-reduce of a single integer): call it on every rank, between
        steps, whenever a shard size changes; the weight holds until the next call. With
        ``no_sync`` accumulation, ``n`` counts the samples of all micro-batches of a step.

        Args:
            n: this rank's samples in the step, >= 0.

        Raises:
            ConfigError: called during a synced backward.
        """
        if self._pending:
            raise ConfigError("set_local_batch_size during a synced backward: call it "
                              "between steps")
        if self._counts is None:  # kept: allocating shared memory costs more than the all-reduce
            self._counts = flat_buffer(self.comm, 2, torch.int64, self.flat_grad.device)
        total = sum_batch_sizes(self.comm, n, self._counts, self.algorithm)
        self.local_batch_size, self.global_batch_size = n, total

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run in here reduce nothing.

        The next forward/backward outside the block reduces the accumulated sum, so k
        micro-batches (each loss scaled by 1/k) take the step of one k-times larger batch.

        Yields:
            None; on leaving the block, syncing is back to what it was.
        """
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def mark_param_as_ready(self, i: int, param: torch.Tensor) -> None:
        """Autograd's word that parameter ``i``'s gradient is complete for this backward.

        Autograd runs a parameter's accumulation, and so this hook, once per backward even
        when the parameter is used twice (tied weights): the two uses are summed first.

        Args:
            i: the parameter's index among the module's trainable parameters.
            param: that parameter, whose ``.grad`` is complete.
        """
        slot = self.grad_slots[i]
        fresh = param.grad if param.grad is not slot else None  # autograd made a new tensor
        if fresh is not None:
            param.grad = slot
        if not self._sync_this_backward:
            if fresh is not None:
                slot.copy_(fresh)
            return
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        # Weighted on the way into the slot: one pass over the gradient (copy and scale fused),
        # not a copy and then a scaling pass over memory the copy just wrote.
        src = slot if fresh is None else fresh
        if self.local_batch_size is None:  # sum of g / p = the average, as DDP pre-divides
            torch.div(src, self.comm.world_size, out=slot)
        elif self.local_batch_size:
            # sum of n_r g_r / N
            torch.mul(src, self.local_batch_size / self.global_batch_size, out=slot)
        else:
            slot.zero_()  # an empty shard: its mean loss (and gradient) is NaN, its weight 0
        self._unready.discard(i)
        self.reducer.mark_param_as_ready(i)

    def wait(self) -> None:
        """Block until this backward's gradients are averaged; a no-op if that is done already.

        Runs by itself at the end of every synced backward. A trainable parameter that got
        no gradient is an error (there is no ``find_unused_parameters``): its slot is
        reduced as zeros first, so every rank still runs the same collectives and none is
        left waiting, and then the error names it.

        Raises:
            ConfigError: a trainable parameter got no gradient, naming it.
            CommError: the bucket all-reduces failed (a timeout, a mismatch, a lost peer).
        """
        if not self._pending:
            return
        self._pending = False
        missing = sorted(self._unready)
        for i in missing:
            self.grad_slots[i].zero_()
            self.reducer.mark_param_as_ready(i)
        try:
            with self.comm.tracer.span("wait", algorithm=self.algorithm):
                self.reducer.wait()
        finally:
            self.reducer.reset()
            self._unready = set(range(len(self.grad_slots)))
        if missing:
            names = ", ".join(self.param_names[i] for i in missing)
            raise ConfigError(f"parameters got no gradient in a synced backward: {names}. Every "
                              "trainable parameter must take part in the loss (unused parameters "
                              "are not supported): freeze it with requires_grad_(False), or add "
                              "0 * p.sum() to the loss")

    finish_gradient_synchronization = wait

    def close(self) -> None:
        """Stop the communication thread and remove the hooks (also done
        when the wrapper is freed)."""
        self._finalizer()


DDP = DistributedDataParallel
