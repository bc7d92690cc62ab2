"""What the reference MLP's operations cost, from its shapes: FLOPs and bytes, op by op.

    from dplab.reference.flops import forward_ops, grad_ops, ComputeHook
    forward_ops(MLPConfig(), layer=0, batch=32, itemsize=8)   # [(flops, bytes)]: x @ W, + b, tanh
    train_sync(comm, cfg, sync, hooks=[ComputeHook(comm, cfg)])  # each phase's ops, on comm.compute

A simulated cluster prices each operation on its device (``Communicator.compute``: the roofline,
max(flops / rate, bytes / bandwidth)); every other backend's ``compute`` does nothing, the work
having taken the time it took. Counted as the code computes: a matmul of (b, i) by (i, o) is
2 b i o FLOPs and reads and writes its operands once; an elementwise operation is one FLOP per
element. The backward of layer l: the gradient pushed down from the layer above (or the loss's,
for the last), then dW += a.T @ delta and db += delta summed over the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from dplab.reference.model import MLPConfig
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.hooks import Hook

__all__ = ["Op", "forward_ops", "loss_ops", "output_ops", "grad_ops", "delta_ops", "backward_ops",
           "model_ops", "optimizer_ops", "ComputeHook"]

Op = tuple[float, float]  # (flops, bytes) of one operation
_OPTIMIZERS = {"sgd": (3, 2), "momentum": (5, 4), "adam": (7, 12), "lars": (5, 6), "lamb": (7, 14)}


def _dims(m: MLPConfig) -> list[tuple[int, int]]:
    dims = (m.in_dim, *m.hidden, m.out_dim)
    return list(zip(dims[:-1], dims[1:]))


def forward_ops(m: MLPConfig, layer: int, batch: int, itemsize: int) -> list[Op]:
    """Layer ``layer``'s forward on ``batch`` samples: x @ W, + b, and the activation (not after
    the last layer)."""
    layers = _dims(m)
    i, o = layers[layer]
    ops = [
        (2.0 * batch * i * o, itemsize * (batch * i + i * o + batch * o)),
        (float(batch * o), itemsize * (2 * batch * o + o)),
    ]
    if layer < len(layers) - 1:
        ops.append((float(batch * o), itemsize * 2.0 * batch * o))
    return ops


def loss_ops(m: MLPConfig, batch: int, itemsize: int) -> list[Op]:
    """The loss over the logits (a difference, a square and a sum; or a log-softmax)."""
    return [(3.0 * batch * m.out_dim, itemsize * 2.0 * batch * m.out_dim)]


def output_ops(m: MLPConfig, batch: int, itemsize: int) -> list[Op]:
    """The loss's gradient with respect to the logits, scaled."""
    return [(2.0 * batch * m.out_dim, itemsize * 3.0 * batch * m.out_dim)]


def grad_ops(m: MLPConfig, layer: int, batch: int, itemsize: int) -> list[Op]:
    """dW += a.T @ delta and db += delta's sum over the batch, for ``layer``."""
    i, o = _dims(m)[layer]
    return [
        (2.0 * batch * i * o, itemsize * (batch * i + batch * o + 2 * i * o)),
        (float(batch * o), itemsize * (batch * o + 2 * o)),
    ]


def delta_ops(m: MLPConfig, layer: int, batch: int, itemsize: int) -> list[Op]:
    """The gradient pushed from ``layer`` down to the layer below: (delta @ W.T) * activation'."""
    i, o = _dims(m)[layer]
    return [
        (2.0 * batch * i * o, itemsize * (batch * o + i * o + batch * i)),
        (2.0 * batch * i, itemsize * 3.0 * batch * i),
    ]


def backward_ops(m: MLPConfig, layer: int, batch: int, itemsize: int) -> list[Op]:
    """What the reference backward computes before it hands ``layer`` on: the gradient that reaches
    the layer (the loss's, or the one pushed down from the layer above), then the layer's own."""
    last = len(_dims(m)) - 1
    reach = (
        output_ops(m, batch, itemsize)
        if layer == last
        else delta_ops(m, layer + 1, batch, itemsize)
    )
    return reach + grad_ops(m, layer, batch, itemsize)


def model_ops(m: MLPConfig, batch: int, itemsize: int) -> list[Op]:
    """One whole forward, loss and backward (a parameter-server worker's gradient)."""
    layers = range(len(_dims(m)))
    return (
        [op for layer in layers for op in forward_ops(m, layer, batch, itemsize)]
        + loss_ops(m, batch, itemsize)
        + [op for layer in reversed(layers) for op in backward_ops(m, layer, batch, itemsize)]
    )


def optimizer_ops(name: str, num_params: int, itemsize: int) -> list[Op]:
    """One optimizer step: passes over memory (weights, gradients, state buffers), a few FLOPs
    each."""
    passes, flops = _OPTIMIZERS.get(name, (3, 2))
    return [(float(flops * num_params), float(passes * num_params * itemsize))]


class ComputeHook(Hook):
    """A recipe hook that hands ``comm.compute`` the reference MLP's operations as they happen: the
    forward and loss, each backward layer before the layer is handed on (so its bucket leaves when
    it would), the optimizer step. Attached on a simulated cluster (``Communicator.simulated``)."""

    def __init__(self, comm: Any, cfg: Any, accum_steps: int = 1) -> None:
        self.comm, self.m = comm, cfg.model
        dtype = np.dtype(cfg.dtype)
        self.itemsize, self.dtype = dtype.itemsize, dtype.name
        lo, hi = chunk_bounds(cfg.global_batch, comm.world_size)[comm.rank]
        self.micro = [b - a for a, b in chunk_bounds(hi - lo, accum_steps)]
        self.step_ops = optimizer_ops(
            cfg.optimizer.name, sum(i * o + o for i, o in _dims(self.m)), self.itemsize
        )

    @contextmanager
    def forward(self, step: int, micro: int) -> Iterator[None]:
        yield
        b = self.micro[micro]
        ops = [
            op
            for layer in range(len(_dims(self.m)))
            for op in forward_ops(self.m, layer, b, self.itemsize)
        ]
        self.comm.compute(ops + loss_ops(self.m, b, self.itemsize), self.dtype)

    def backward(self, step: int, micro: int, layers: Iterator[int]) -> Iterator[int]:
        for layer in layers:
            self.comm.compute(
                backward_ops(self.m, layer, self.micro[micro], self.itemsize), self.dtype
            )
            yield layer

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        yield
        if name == "optimizer":
            self.comm.compute(self.step_ops, self.dtype)
