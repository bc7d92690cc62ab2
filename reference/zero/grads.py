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
    """Stages 0-1: the whole gradient on every rank; reduced once per step, on the last
    micro-batch.

    Args:
        ledger: counts the gradient.
        layout: who owns which chunk.
        dtype: the gradient's dtype.
        stage: 0 (all-reduce) or 1 (reduce-scatter).
        comm: this rank's communicator.
        comm_thread: where the reductions run.
        algorithm: the collectives' algorithm.
    """

    def __init__(self, ledger: MemoryLedger, layout: ShardLayout, dtype: DTypeLike, stage: int,
                 comm: Communicator, comm_thread: CommThread, algorithm: str) -> None:
        self.layout, self.stage = layout, stage
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.full = ledger.zeros("grads", sum(layout.sizes), dtype)
        self.handles: list[Handle] = []

    def begin_step(self) -> None:
        """Zero the gradient before a step's first micro-batch.

        """
        self.full[:] = 0
        self.handles = []

    def buffer(self, layer: int) -> np.ndarray:
        """Where backward adds ``layer``'s gradient: its slice of the full gradient.

        Args:
            layer: the layer.

        Returns:
            A view of the full gradient.
        """
        return self.full[self.layout.layers[layer]]

    def ready(self, layer: int, g: np.ndarray, last_micro: bool) -> None:
        """``layer``'s gradient is complete for this micro-batch: on the last, queue its reduction.

        Args:
            layer: the layer.
            g: its gradient (``buffer(layer)``).
            last_micro: whether this is the step's last micro-batch (earlier ones only accumulate).
        """
        if last_micro:  # earlier micro-batches only accumulate (no_sync)
            reduce = allreduce if self.stage == 0 else reduce_scatter
            self.handles.append(self.comm_thread.submit(reduce, self.comm, g, self.algorithm))

    def end_micro(self) -> None:
        """After a micro-batch's backward: nothing to do here (every reduction waits for ``wait``).

        """
        pass

    def wait(self) -> None:
        """Block until every queued reduction is done.

        Raises:
            CommTimeout: the comm thread made no progress within the timeout.
        """
        for h in self.handles:
            h.wait()
        self.handles = []

    def of(self, layer: int) -> np.ndarray:
        """The reduced gradient this rank steps ``layer`` with.

        Args:
            layer: the layer.

        Returns:
            The whole layer's (stage 0) or this rank's chunk of it (stage 1).
        """
        g = self.full[self.layout.layers[layer]]
        return g if self.stage == 0 else g[self.layout.own(layer)]


class ShardedGrads:
    """Stages 2-3: only this rank's summed chunk of each layer's gradient is kept.

    Args:
        ledger: counts the gradients.
        layout: who owns which chunk.
        dtype: the gradient's dtype.
        comm: this rank's communicator.
        comm_thread: where the reductions run.
        algorithm: the collectives' algorithm.
    """

    def __init__(self, ledger: MemoryLedger, layout: ShardLayout, dtype: DTypeLike,
                 comm: Communicator, comm_thread: CommThread, algorithm: str) -> None:
        self.ledger, self.layout, self.dtype = ledger, layout, np.dtype(dtype)
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.shards = [
            ledger.zeros("grads", layout.own_size(i), dtype) for i in range(len(layout.sizes))
        ]
        self.pending: deque[tuple[int, np.ndarray, Handle]] = deque()

    def begin_step(self) -> None:
        """Zero this rank's gradient chunks before a step's first micro-batch.

        """
        for s in self.shards:
            s[:] = 0

    def buffer(self, layer: int) -> np.ndarray:
        # freed once reduced
        """A fresh full-size buffer for ``layer``'s gradient, freed once it is reduce-scattered.

        Args:
            layer: the layer.

        Returns:
            A zeroed array, counted by the ledger.
        """
        return self.ledger.zeros("grads", self.layout.sizes[layer], self.dtype)

    def ready(self, layer: int, g: np.ndarray, last_micro: bool) -> None:
        """``layer``'s gradient is complete: reduce-scatter it now, while the layers below compute.

        Args:
            layer: the layer.
            g: its gradient (``buffer(layer)``).
            last_micro: unused: every micro-batch is reduced (no full gradient is kept to add
                into).
        """
        self.pending.append(
            (layer, g, self.comm_thread.submit(reduce_scatter, self.comm, g, self.algorithm))
        )
        while len(self.pending) > 1:
            # the previous layer's reduction overlapped this layer's compute
            self._retire()

    def end_micro(self) -> None:
        """Wait for this micro-batch's reductions and add each rank's chunk into its shard.

        Raises:
            CommTimeout: the comm thread made no progress within the timeout.
        """
        while self.pending:
            self._retire()

    def wait(self) -> None:
        """Block until every reduction is done and added (``end_micro``).

        Raises:
            CommTimeout: the comm thread made no progress within the timeout.
        """
        self.end_micro()

    def of(self, layer: int) -> np.ndarray:
        """This rank's reduced chunk of ``layer``'s gradient.

        Args:
            layer: the layer.

        Returns:
            The chunk.
        """
        return self.shards[layer]

    def _retire(self) -> None:
        layer, g, handle = self.pending.popleft()
        handle.wait()
        self.shards[layer] += g[self.layout.own(layer)]  # the reduce-scatter summed my chunk
        self.ledger.free(g)
