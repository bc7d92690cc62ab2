"""Mixed precision in the ZeRO trainer: loss scaling and the unscaled step of sharded masters.

    scaler = LossScaler(zero.precision, comm.tracer)        # dplab.reference.precision
    ...backward with scale * scaler.loss_scale, gradients reduced in reduce_dtype...
    stepped = amp_step(comm, algorithm, scaler, ledger, opts, params, grads, step)

As ``train_sync`` does (torch AMP's order), with one difference ZeRO forces: after a
reduce-scatter each rank holds a different part of the gradient, so "did anything overflow?"
is one float all-reduced over the ranks; every rank then skips or steps together. The check
reads the reduced (still scaled) gradients: dividing a finite number by S stays finite in
float32, so an inf or nan there is exactly one after unscaling. Then, layer by layer, the
gradient is divided by S into a float32 buffer of what this rank updates (a "grads" array the
ledger counts, one layer at a time), the optimizer steps the float32 master, and the buffer
goes; ``params.after_step`` rounds the masters into the float16 weights.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.optim import Optimizer
from dplab.reference.precision.scaler import LossScaler
from dplab.reference.zero.grads import FullGrads, ShardedGrads
from dplab.reference.zero.ledger import MemoryLedger
from dplab.reference.zero.params import ReplicatedParams, ShardedParams

__all__ = ["amp_step"]


def amp_step(comm: Communicator, algorithm: str, scaler: LossScaler, ledger: MemoryLedger,
             opts: list[Optimizer], params: ReplicatedParams | ShardedParams,
             grads: FullGrads | ShardedGrads, step: int) -> bool:
    """Unscale, check, and step every layer's master, or skip on an overflow; True if it stepped.

    Args:
        comm: this rank's communicator.
        algorithm: the all-reduce for the one-element overflow flag.
        scaler: the loss scaler; its scale is updated here.
        ledger: counts the float32 gradient made per layer.
        opts: one optimizer per layer.
        params: the masters to step.
        grads: the scaled float16 gradients.
        step: the step, for the trace and the error.

    Returns:
        True if every layer stepped; False if the step was skipped (an overflow on some rank).

    Raises:
        ConfigError: an overflow at a static loss scale (``LossScaler.update``).
    """
    s = scaler.loss_scale  # the S this step's backward used (update may change it)
    found = any(not np.isfinite(grads.of(layer)).all() for layer in range(len(opts)))
    flag = np.array([1.0 if found else 0.0])
    allreduce(comm, flag, algorithm)  # one rank's overflow is everyone's
    if not scaler.update(bool(flag[0] > 0), step):
        return False
    for layer, opt in enumerate(opts):
        master = params.master(layer)
        g = ledger.zeros("grads", len(master), master.dtype)
        np.divide(grads.of(layer), np.float32(s), out=g, casting="same_kind")
        opt.step(master, g)
        ledger.free(g)
        del g
    return True
