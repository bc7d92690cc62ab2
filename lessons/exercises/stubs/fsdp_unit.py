"""Exercise (lesson 10): an FSDP unit's gather and free.

FSDP (ZeRO stage 3) keeps on each rank only a SHARD of every unit's weights: a unit's n flat
weights are cut into p chunks, chunk_bounds(n, p), and rank r holds chunk r. To run a unit, a
rank needs its whole weights for a moment: gather them, run, and free them again, so that a rank
holds its shards plus one unit at a time. Backward gathers once more, and the unit's gradient is
reduce-scattered, so that each rank keeps only its chunk of the sum, for its shard's optimizer.

Write the two moves around one unit (the collectives in dplab/reference/collectives.py work in
place on every rank):

    unit_forward(comm, shard, n, forward)
        shard     this rank's chunk of the unit's n weights
        forward   forward(w) runs the unit with its whole weights w and returns its output
        return    forward's output; the gathered weights must not outlive the call

    unit_backward(comm, shard, n, backward, grad_shard)
        backward    backward(w) returns the unit's whole gradient of this rank's samples (call it
                    once)
        grad_shard  room for this rank's chunk of the gradient SUMMED over the ranks:
        fill it in place keep nothing else: neither the gathered weights nor the whole gradient

Each rank's loss is already scaled by 1/global batch: the ranks' gradients SUM to the one-device
gradient. The check runs a model of 8 units on 1..4 ranks and judges every call: its values, the
bytes it sent, and what it left allocated when it returned.

The bodies below do not gather at all. Check yours:

    dplab lesson check 10 DIR
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allgather, allreduce, reduce_scatter  # noqa: F401 (yours to use)
from dplab.reference.schedule import chunk_bounds  # noqa: F401 (yours to use)


def unit_forward(comm, shard: np.ndarray, n: int, forward):
    w = np.zeros(n, dtype=shard.dtype)
    w[:len(shard)] = shard  # only this rank's chunk, at the start: the rest is missing
    return forward(w)


def unit_backward(comm, shard: np.ndarray, n: int, backward, grad_shard: np.ndarray) -> None:
    w = np.zeros(n, dtype=shard.dtype)
    w[:len(shard)] = shard
    g = backward(w)
    grad_shard[:] = g[:len(grad_shard)]
