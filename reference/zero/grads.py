"""Where a rank's gradients live: a full vector (stages 0-1) or only its shards (stages 2-3).

    g = grads.buffer(layer)      # where the backward ADDS layer's gradient
    ...layer_grads(..., g)...
    grads.ready(layer, g, last)  # start its reduction on the comm thread; del g after
    grads.end_micro()            # after each micro-batch's backward
    grads.wait()                 # before the optimizer: every reduction done
    grads.of(layer)              # the summed gradient the optimizer takes (all of it, or my chunk)

Stages 0-1 accumulate micro-batches into one full vector and reduce the last one's layers as
backward yields them (all-reduce, or reduce-scatter in stage 1). Stages 2-3 reduce-scatter each
micro-batch's layer at once into a fresh buffer, add the owned chunk and free it: at most two
layer buffers exist at once, one reduce-scatter per micro-batch.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.collectives import allreduce, reduce_scatter
from dplab.reference.communicator import Communicator
from dplab.reference.zero.layout import ShardLayout
from dplab.reference.zero.ledger import MemoryLedger
from dplab.reference.zero.overlap import CommThread, Handle

__all__ = ["FullGrads", "ShardedGrads"]


class FullGrads:
    """Stages 0-1: the whole gradient on every rank; reduced once per step, on the last micro-batch."""

    def __init__(self, ledger: MemoryLedger, layout: ShardLayout, dtype: DTypeLike, stage: int,
                 comm: Communicator, comm_thread: CommThread, algorithm: str) -> None:
        self.layout, self.stage = layout, stage
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.full = ledger.zeros("grads", sum(layout.sizes), dtype)
        self.handles: list[Handle] = []

    def begin_step(self) -> None:
        self.full[:] = 0
        self.handles = []

    def buffer(self, layer: int) -> np.ndarray:
        return self.full[self.layout.layers[layer]]

    def ready(self, layer: int, g: np.ndarray, last_micro: bool) -> None:
        if last_micro:  # earlier micro-batches only accumulate (no_sync)
            reduce = allreduce if self.stage == 0 else reduce_scatter
            self.handles.append(self.comm_thread.submit(reduce, self.comm, g, self.algorithm))

    def end_micro(self) -> None:
        pass

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []

    def of(self, layer: int) -> np.ndarray:
        g = self.full[self.layout.layers[layer]]
        return g if self.stage == 0 else g[self.layout.own(layer)]


class ShardedGrads:
    """Stages 2-3: only this rank's summed chunk of each layer's gradient is kept."""

    def __init__(self, ledger: MemoryLedger, layout: ShardLayout, dtype: DTypeLike,
                 comm: Communicator, comm_thread: CommThread, algorithm: str) -> None:
        self.ledger, self.layout, self.dtype = ledger, layout, np.dtype(dtype)
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.shards = [ledger.zeros("grads", layout.own_size(i), dtype) for i in range(len(layout.sizes))]
        self.pending: deque[tuple[int, np.ndarray, Handle]] = deque()

    def begin_step(self) -> None:
        for s in self.shards:
            s[:] = 0

    def buffer(self, layer: int) -> np.ndarray:
        return self.ledger.zeros("grads", self.layout.sizes[layer], self.dtype)  # freed once reduced

    def ready(self, layer: int, g: np.ndarray, last_micro: bool) -> None:
        self.pending.append((layer, g, self.comm_thread.submit(reduce_scatter, self.comm, g, self.algorithm)))
        while len(self.pending) > 1:  # the previous layer's reduction overlapped this layer's compute
            self._retire()

    def end_micro(self) -> None:
        while self.pending:
            self._retire()

    def wait(self) -> None:
        self.end_micro()

    def of(self, layer: int) -> np.ndarray:
        return self.shards[layer]

    def _retire(self) -> None:
        layer, g, handle = self.pending.popleft()
        handle.wait()
        self.shards[layer] += g[self.layout.own(layer)]  # the reduce-scatter summed my chunk
        self.ledger.free(g)
