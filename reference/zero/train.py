"""ZeRO stages 0-3 in the reference trainer: data parallelism that shards its model states.

    from dplab.backends import launch
    from dplab.reference.train.single import TrainConfig, train_single
    from dplab.reference.zero.train import ZeroConfig, train_zero
    results = launch(train_zero, 4, args=(TrainConfig(), ZeroConfig(stage=3)))
    results[0].params      # within 1e-10 (relative, float64) of train_single(TrainConfig()).params
    results[r].memory      # rank r's peak bytes of params, grads, optimizer state during a step

Rank r owns chunk r of every layer's flat slice (``layout.py``); what each stage keeps whole,
and the elements moved per step and rank ((p-1)/p of that many, Psi parameters):

    stage  weights        gradients                        optimizer state  moved per step
    0      all            all, all-reduced                 all              2 Psi
    1      all            all, reduce-scattered            my chunks        2 Psi
    2      all            my chunks: reduce-scatter each   my chunks        2 Psi (1 micro-batch)
                          layer as backward yields it,
                          free
    3      my chunks: gather a layer before its forward    my chunks        3 Psi
           and again before its backward, free after

One step is ``dplab.reference.train.sync``'s recipe, a layer at a time (``params.py``,
``grads.py``); why it works: reference/README.md, "Beyond replicas: ZeRO, mixed precision, large
batches".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from dplab.reference.collectives import allreduce, broadcast
from dplab.reference.communicator import Communicator
from dplab.reference.data import batch_indices, shard
from dplab.reference.flops import (
    delta_ops,
    forward_ops,
    grad_ops,
    loss_ops,
    optimizer_ops,
    output_ops,
)
from dplab.reference.model import MLP
from dplab.reference.optim import LAYERWISE, make_optimizer
from dplab.reference.precision.scaler import LossScaler
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, TrainResult, setup
from dplab.reference.zero.amp import amp_step
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.grads import FullGrads, ShardedGrads
from dplab.reference.zero.layers import layer_delta, layer_forward, layer_grads, output_delta
from dplab.reference.zero.layerwise import chunk_tensors, shard_norms
from dplab.reference.zero.layout import ShardLayout
from dplab.reference.zero.ledger import MemoryLedger, MemoryReport
from dplab.reference.zero.overlap import CommThread
from dplab.reference.zero.params import ReplicatedParams, ShardedParams

__all__ = ["ZeroConfig", "ZeroResult", "train_zero", "forward", "backward"]


@dataclass
class ZeroResult(TrainResult):
    """``TrainResult`` (full ``params`` on every rank, the global ``losses``) plus what it cost.

    Args:
        params: the final flat parameters.
        losses: each step's global-batch loss.
        memory: this rank's peak bytes during the steps.
        shard_elems: the parameters this rank owns.
    """

    memory: MemoryReport | None = None  # this rank's peak bytes during the steps
    shard_elems: int = 0  # parameters this rank owns (sum over ranks: num_params)


_DEFAULT = ZeroConfig()  # stage 1, ring, one micro-batch


def train_zero(comm: Communicator, cfg: TrainConfig, zero: ZeroConfig = _DEFAULT,
               ledger: MemoryLedger | None = None) -> ZeroResult:
    """Run on every rank; returns the full final parameters, the losses and this rank's memory
    peaks.

    ``ledger``: pass one to watch allocations as they happen (the tracemalloc test does).

    Args:
        comm: this rank's communicator.
        cfg: the run's configuration.
        zero: the stage, algorithm, micro-batches, prefetch and precision.
        ledger: the memory ledger to count in (a new one if None).

    Returns:
        The final parameters, the losses, and this rank's measured memory peaks.

    Raises:
        ConfigError: an invalid configuration, or a diverged run.
        CommError: a collective failed (a timeout, a mismatch, a lost peer).
    """
    zero.validate(comm.world_size)
    model, data, init = setup(cfg)
    prec = zero.precision  # None: one dtype throughout; else float16 compute, float32 masters
    if prec is not None:
        prec.validate(init.dtype)
    compute = np.dtype(cfg.dtype if prec is None else prec.compute_dtype)
    reduce = np.dtype(cfg.dtype if prec is None else prec.reduce_dtype)
    scaler = None if prec is None else LossScaler(prec, comm.tracer)
    if comm.rank != 0:  # anything but rank 0's weights: the broadcast must fix it
        init = model.init_params(cfg.seed + 1 + comm.rank, dtype=init.dtype)
    broadcast(comm, init, root=0)  # every rank starts from rank 0's parameters
    ledger = ledger if ledger is not None else MemoryLedger()
    layout = ShardLayout(model, comm.world_size, comm.rank)
    comm_thread = CommThread(comm)
    where = (comm, comm_thread, zero.algorithm)
    if zero.stage < 3:
        params = ReplicatedParams(ledger, layout, init, zero.stage >= 1, compute, *where)
    else:
        params = ShardedParams(ledger, layout, init, zero.prefetch, compute, *where,
                               reshard_after_forward=zero.reshard_after_forward)
    itemsize = init.dtype.itemsize
    del init  # stage 3: the full vector existed only to be cut into shards (before any step)
    grads = FullGrads(ledger, layout, reduce, zero.stage, *where) if zero.stage < 2 else \
        ShardedGrads(ledger, layout, reduce, *where)
    # what this rank updates
    sizes = [len(params.master(layer)) for layer in range(model.num_layers)]
    opts = [ledger.track("optimizer", partial(make_optimizer, cfg.optimizer, n, cfg.dtype,
                                              chunk_tensors(model, layout, layer, zero.stage == 0)))
            for layer, n in enumerate(sizes)]
    if cfg.optimizer.name in LAYERWISE and zero.stage > 0:  # LARS/LAMB: norms of whole tensors
        for opt in opts:
            opt.norms = partial(shard_norms, comm, zero.algorithm)
    tracer, scale, losses = comm.tracer, 1 / cfg.global_batch, []
    ledger.reset_peaks()  # the peaks are the steps', not the set-up's
    try:
        for step in range(cfg.steps):
            batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
            mine = shard(batch, comm.rank, comm.world_size)  # 1. this rank's shard of the batch
            loss = 0.0
            with tracer.span("zero_step", extra={"step": step, "stage": zero.stage}):
                # mixed: the loss times S
                scaled = scale if scaler is None else scale * scaler.loss_scale
                params.begin_step(zero.accum_steps)
                grads.begin_step()
                for j, (a, b) in enumerate(chunk_bounds(len(mine), zero.accum_steps)):
                    x, y = data.x[mine[a:b]].astype(compute, copy=False), data.y[mine[a:b]]
                    with tracer.span("forward", extra={"step": step, "micro": j}):
                        acts = forward(model, params, x)  # 2.
                        loss += model.loss(acts, y, scale)
                    with tracer.span("backward", extra={"step": step, "micro": j}):
                        # 3.
                        backward(model, params, grads, acts, y, scaled, j == zero.accum_steps - 1)
                with tracer.span("wait", extra={"step": step}):
                    grads.wait()  # 4. every reduction done
                with tracer.span("optimizer", extra={"step": step}):
                    if scaler is None:
                        for layer, opt in enumerate(opts):  # 4. each rank steps what it owns
                            opt.step(params.master(layer), grads.of(layer))
                            comm.compute(optimizer_ops(cfg.optimizer.name, sizes[layer], itemsize),
                                         cfg.dtype)
                    # mixed: unscale, or skip on overflow
                    stepped = scaler is None or amp_step(comm, zero.algorithm, scaler, ledger,
                                                         opts, params, grads, step)
                    if stepped:
                        params.after_step()  # 5. stages 1-2: all-gather the updated chunks
            total = np.array([loss])
            allreduce(comm, total, zero.algorithm)  # the global batch's loss, for the log
            losses.append(float(total[0]))
        final = params.gather_full()  # after the steps: not counted in the peaks
    finally:
        comm_thread.close()
    return ZeroResult(final, losses, ledger.report(), layout.shard_elems)


def forward(
    model: MLP, params: ReplicatedParams | ShardedParams, x: np.ndarray
) -> list[np.ndarray]:
    """Every layer's input and the output, computed with one layer's weights at a time.

    Args:
        model: the MLP.
        params: the weights, replicated or sharded.
        x: the micro-batch's inputs.

    Returns:
        [x, each layer's output], the last one the logits.
    """
    acts, compute, size = [x], params.comm.compute, (len(x), x.dtype.itemsize)  # sim's clock
    for layer in range(model.num_layers):
        w = params.acquire(layer)  # stage 3: all-gathered now (and the next layer's gather starts)
        acts.append(layer_forward(model, layer, w, acts[-1]))
        compute(forward_ops(model.cfg, layer, *size), x.dtype.name)
        params.release(w)
        del w  # a released layer must not stay alive through us: the ledger would lie
    return acts


def backward(model: MLP, params: ReplicatedParams | ShardedParams, grads: FullGrads | ShardedGrads,
             acts: list[np.ndarray], y: np.ndarray, scale: float, last_micro: bool) -> None:
    """Gradients last layer first, each handed to ``grads`` (and its reduction) the moment it
    exists.

    Args:
        model: the MLP.
        params: the weights, replicated or sharded.
        grads: where the gradients go, and how they are reduced.
        acts: what ``forward`` returned.
        y: the targets.
        scale: the loss's scale.
        last_micro: whether this is the step's last micro-batch.
    """
    delta = output_delta(model, acts[-1], y, scale)
    compute, size, dtype = params.comm.compute, (len(y), acts[0].dtype.itemsize), acts[0].dtype.name
    compute(loss_ops(model.cfg, *size) + output_ops(model.cfg, *size), dtype)
    for layer in reversed(range(model.num_layers)):
        w = params.acquire(layer)  # stage 3: gathered again (the forward's copy was freed)
        g = grads.buffer(layer)
        layer_grads(model, layer, acts[layer], delta, g)
        compute(grad_ops(model.cfg, layer, *size), dtype)
        grads.ready(layer, g, last_micro)  # its reduction runs while the layers below compute
        del g
        if layer > 0:
            delta = layer_delta(model, layer, w, acts[layer], delta)
            compute(delta_ops(model.cfg, layer, *size), dtype)
        params.release(w)
        del w
    grads.end_micro()
