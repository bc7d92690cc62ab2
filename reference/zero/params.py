"""Where a rank's parameters live: replicated (stages 0-2) or sharded and gathered (stage 3).

    w = params.acquire(layer)    # layer's flat weights [W, b] to compute with (stage 3: gathered)
    params.release(w); del w     # done with them (stage 3: freed, for real: drop the reference)
    params.master(layer)         # what the optimizer steps: this rank's chunk, or all of it

The master is a view of the weights in float64 or float32; with ``compute_dtype`` float16 it is
a float32 array of what this rank updates, counted as optimizer state, and ``after_step`` rounds
it into the compute weights. Stage 3 with ``prefetch``: ``acquire`` hands the NEXT use's gather
to the comm thread, so at most two gathered layers are held at once (``reshard_after_forward=False``
keeps each layer's forward gather until its backward: no second gather, every layer held at once):

    main   [fwd 0][fwd 1][fwd 2][bwd 2][bwd 1][bwd 0]
    comm   [g0]   [g1]   [g2]   [g2]   [g1]   [g0]        g = all-gather of that layer
           (with prefetch, g(k+1) runs under the compute of k; only g0 of forward is waited for)
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allgather
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.precision.scaler import compute_copy
from dplab.reference.zero.layout import ShardLayout
from dplab.reference.zero.ledger import MemoryLedger
from dplab.reference.zero.overlap import CommThread, Handle

__all__ = ["ReplicatedParams", "ShardedParams", "use_plan"]


def _copy(ledger: MemoryLedger, values: np.ndarray) -> np.ndarray:
    """A float32 master: optimizer state in the paper's count (only the optimizer step reads it)."""
    master = ledger.zeros("optimizer", len(values), values.dtype)
    master[:] = values
    return master


def use_plan(num_layers: int, accum_steps: int) -> list[int]:
    """The layers one step uses, in order: per micro-batch, forward 0..L-1 then backward L-1..0.

    Args:
        num_layers: the model's layers.
        accum_steps: micro-batches per step.

    Returns:
        Layer indices, in the order the step acquires them.
    """
    one = [*range(num_layers), *reversed(range(num_layers))]
    return one * accum_steps


class ReplicatedParams:
    """Stages 0-2: every rank holds every parameter in one flat vector (a replica).

    Args:
        ledger: counts the weights.
        layout: who owns which chunk.
        init: the initial parameters.
        sharded_update: stages 1-2: each rank steps only its chunks, then all-gathers.
        compute_dtype: the weights' dtype (float16 under mixed precision).
        comm: this rank's communicator.
        comm_thread: where the gathers run.
        algorithm: the collectives' algorithm.
    """

    def __init__(
        self,
        ledger: MemoryLedger,
        layout: ShardLayout,
        init: np.ndarray,
        sharded_update: bool,
        compute_dtype: np.dtype,
        comm: Communicator,
        comm_thread: CommThread,
        algorithm: str,
    ) -> None:
        self.layout, self.sharded_update = layout, sharded_update
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.full = ledger.zeros("params", len(init), compute_dtype)
        compute_copy(init, self.full)
        # mixed precision: float32 masters
        self.masters = None if compute_dtype == init.dtype else [
            _copy(ledger, init[s][layout.own(i)] if sharded_update else init[s])
            for i, s in enumerate(layout.layers)]

    def begin_step(self, accum_steps: int) -> None:
        """Before a step: nothing to do (every layer is always here).

        Args:
            accum_steps: the step's micro-batches.
        """
        pass

    def acquire(self, layer: int) -> np.ndarray:
        """The weights of ``layer`` to compute with: here a view of the full copy.

        Args:
            layer: the layer.

        Returns:
            Its flat slice ``[W, b]``.
        """
        return self.full[self.layout.layers[layer]]

    def release(self, w: np.ndarray) -> None:
        """Done computing with ``w``: nothing to free here.

        Args:
            w: what ``acquire`` returned.
        """
        pass

    def master(self, layer: int) -> np.ndarray:
        """Stage 0: the whole layer; stages 1-2: this rank's chunk of it (a view: stepped in
        place).

        Args:
            layer: the layer.

        Returns:
            What this rank's optimizer steps for ``layer``.
        """
        if self.masters is not None:
            return self.masters[layer]
        return self._mine(layer)

    def after_step(self) -> None:
        """Stages 1-2: each rank updated only its chunks; the all-gather brings everyone the
        rest."""
        if self.masters is not None:  # round the updated masters into the float16 weights
            for layer, master in enumerate(self.masters):
                compute_copy(master, self._mine(layer))
        if self.sharded_update:
            handles = [self.comm_thread.submit(allgather, self.comm, self.full[s], self.algorithm)
                       for s in self.layout.layers]
            for h in handles:
                h.wait()

    def gather_full(self) -> np.ndarray:
        """Every parameter: the masters where there are some (for the result; not counted).

        Returns:
            The full parameter vector.
        """
        if self.masters is None:
            return self.full.copy()
        full = np.empty(len(self.full), self.masters[0].dtype)
        for layer, s in enumerate(self.layout.layers):
            mine = self.layout.own(layer) if self.sharded_update else slice(None)
            full[s][mine] = self.masters[layer]
            if self.sharded_update:
                self.comm_thread.submit(allgather, self.comm, full[s], self.algorithm).wait()
        return full

    def _mine(self, layer: int) -> np.ndarray:
        w = self.full[self.layout.layers[layer]]
        return w[self.layout.own(layer)] if self.sharded_update else w


class ShardedParams:
    """Stage 3: a rank holds only its chunk of each layer; a layer is all-gathered when used.

    Args:
        ledger: counts the weights.
        layout: who owns which chunk.
        init: the initial parameters, cut into this rank's chunks.
        prefetch: gather the next layer while this one computes.
        compute_dtype: the weights' dtype (float16 under mixed precision).
        comm: this rank's communicator.
        comm_thread: where the gathers run.
        algorithm: the collectives' algorithm.
    """

    def __init__(self, ledger: MemoryLedger, layout: ShardLayout, init: np.ndarray, prefetch: bool,
                 compute_dtype: np.dtype, comm: Communicator, comm_thread: CommThread,
                 algorithm: str, reshard_after_forward: bool = True) -> None:
        self.ledger, self.layout, self.prefetch = ledger, layout, prefetch
        self.reshard = reshard_after_forward  # False: forward's gathers are kept for backward
        self.kept: dict[int, np.ndarray] = {}
        self.dtype = np.dtype(compute_dtype)
        self.comm, self.comm_thread, self.algorithm = comm, comm_thread, algorithm
        self.shards = []
        for layer, s in enumerate(layout.layers):
            shard = ledger.zeros("params", layout.own_size(layer), compute_dtype)
            compute_copy(init[s][layout.own(layer)], shard)
            self.shards.append(shard)
        self.masters = None if self.dtype == init.dtype else [  # mixed precision: float32 masters
            _copy(ledger, init[s][layout.own(i)]) for i, s in enumerate(layout.layers)]
        self.plan: list[int] = []
        self.i = 0
        self.next: tuple[np.ndarray, Handle] | None = None

    def begin_step(self, accum_steps: int) -> None:
        """Before a step: the order its micro-batches will acquire the layers in (``use_plan``).

        Args:
            accum_steps: the step's micro-batches.
        """
        self.plan, self.i, self.next = use_plan(len(self.shards), accum_steps), 0, None

    def acquire(self, layer: int) -> np.ndarray:
        """``layer``'s whole weights, all-gathered (or prefetched), and the next gather started.

        Args:
            layer: the layer; layers must come in ``use_plan``'s order.

        Returns:
            Its flat slice ``[W, b]``, counted by the ledger until ``release``.

        Raises:
            ConfigError: a layer out of order.
            CommTimeout: the gather made no progress within the timeout.
        """
        if self.i >= len(self.plan) or self.plan[self.i] != layer:
            raise ConfigError(f"stage 3 uses layers in the order {self.plan}; use {self.i} asked "
                              f"for layer {layer}: acquire layers in the order of forward, then "
                              "backward")
        if layer in self.kept:  # not resharded after forward: backward needs no second gather
            buf = self.kept.pop(layer)
        else:
            if self.next is None:  # not prefetched: gather it now
                self.next = self._gather(layer)
            buf, handle = self.next
            self.next = None
            handle.wait()
        self.i += 1
        kept_next = not self.reshard and self._backward(self.i)  # it will be kept, not gathered
        if self.prefetch and self.i < len(self.plan) and not kept_next:
            self.next = self._gather(self.plan[self.i])  # arrives while this layer computes
        return buf

    def release(self, w: np.ndarray) -> None:
        """Free the gathered weights ``acquire`` returned (or, not resharding after forward,
        keep a forward's weights for its backward).

        Args:
            w: what ``acquire`` returned.
        """
        if not self.reshard and not self._backward(self.i - 1):
            self.kept[self.plan[self.i - 1]] = w  # held from its forward to its backward
            return
        self.ledger.free(w)

    def _backward(self, use: int) -> bool:
        """Whether use ``use`` of the plan is a backward one (a micro-batch: L forward, L back)."""
        return use % (2 * len(self.shards)) >= len(self.shards)

    def master(self, layer: int) -> np.ndarray:
        """This rank's chunk of ``layer``: what its optimizer steps (float32 masters, if any).

        Args:
            layer: the layer.

        Returns:
            The chunk, stepped in place.
        """
        return self.shards[layer] if self.masters is None else self.masters[layer]

    def after_step(self) -> None:
        """The shards are the parameters; the next step gathers the updated ones."""
        if self.masters is not None:
            for shard, master in zip(self.shards, self.masters, strict=True):
                compute_copy(master, shard)

    def gather_full(self) -> np.ndarray:
        """All parameters (the masters, if any) on every rank:
        the result, after the steps, not counted.

        Returns:
            The full parameter vector.
        """
        mine = self.shards if self.masters is None else self.masters
        full = np.empty(sum(self.layout.sizes), mine[0].dtype)
        for layer, s in enumerate(self.layout.layers):
            full[s][self.layout.own(layer)] = mine[layer]
            self.comm_thread.submit(allgather, self.comm, full[s], self.algorithm).wait()
        return full

    def _gather(self, layer: int) -> tuple[np.ndarray, Handle]:
        buf = self.ledger.empty("params", self.layout.sizes[layer], self.dtype)
        # my chunk in; the all-gather brings the rest
        buf[self.layout.own(layer)] = self.shards[layer]
        return buf, self.comm_thread.submit(allgather, self.comm, buf, self.algorithm)
