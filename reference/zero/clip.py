"""Gradient clipping by the global norm when every rank holds only a shard of the gradient.

    from dplab.reference.zero.clip import clip_grad_norm
    total = clip_grad_norm(comm, shards, max_norm=1.0)   # on every rank, after the reduce-scatter

``torch.nn.utils.clip_grad_norm_`` scales the whole gradient g by min(1, max_norm / (||g|| + 1e-6)).
Under ZeRO-2/3 and FSDP no rank holds g: rank r holds its chunks g_r of every layer, summed over
the ranks by the reduce-scatter. The squared norm adds over disjoint chunks, the norm does not:

    ||g||^2 = sum over r of ||g_r||^2        so one all-reduce of ONE number per rank is enough

Each rank then scales its own chunks by the same coefficient, and the result is bitwise what the
one-device clip would leave in those chunks, up to the order of the additions. Clipping each shard
by its own norm (a different coefficient on every rank) is the common bug; the others (all-reducing
the norms, averaging, forgetting the square root) are lesson 10's exercise.
"""

from __future__ import annotations

import math

import numpy as np

from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator

__all__ = ["EPS", "clip_coef", "clip_grad_norm"]

EPS = 1e-6  # torch's: keeps the coefficient finite for a zero gradient


def clip_coef(total_norm: float, max_norm: float) -> float:
    """torch's coefficient, ``min(1, max_norm / (total_norm + 1e-6))``: clipping never enlarges.

    Args:
        total_norm: the whole gradient's 2-norm.
        max_norm: the largest norm the clipped gradient may have.

    Returns:
        The factor every gradient element is multiplied by, in (0, 1].
    """
    return min(1.0, max_norm / (total_norm + EPS))


def clip_grad_norm(comm: Communicator, shards: list[np.ndarray], max_norm: float,
                   algorithm: str = "ring") -> float:
    """Scale this rank's gradient chunks in place so that the WHOLE gradient's norm is at most
    ``max_norm``; a collective (call it on every rank, after the reduce-scatter has completed).

    Args:
        comm: the ranks that hold the gradient between them.
        shards: this rank's chunks of the summed gradient (any number, empty ones included).
        max_norm: the largest norm the whole gradient may keep.
        algorithm: the all-reduce of the squared norms.

    Returns:
        The global norm before clipping, the same on every rank (as torch returns it).
    """
    squares = np.array([sum(float(np.dot(s, s)) for s in shards)])
    allreduce(comm, squares, algorithm)  # a sum of squares, never of norms: norms do not add
    total = math.sqrt(squares[0])
    coef = clip_coef(total, max_norm)
    for s in shards:
        s *= coef
    return total
