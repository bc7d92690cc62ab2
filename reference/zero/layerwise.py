"""LARS and LAMB under ZeRO: whole-tensor norms from the chunks the ranks hold.

LARS and LAMB scale each tensor's step by ``||w|| / ||g||`` (or ``||w|| / ||u||``): norms of the
WHOLE weight matrix and the whole bias. Under stages 1-3 a rank updates only its chunk of each
layer's flat ``[W_l, b_l]``, which may cut W, b, or both. The squares add across chunks, so one
small all-reduce per layer gives every rank the whole norms:

    layer l's flat range  [ W_l ............................ | b_l .... ]
    rank 0's chunk        [ w-part ...... ]                                  ||W||^2 = sum of the
    rank 1's chunk                        [ w-part ......... | b-part ]      ranks' w-parts' squares
    rank 2's chunk                                                  [ ... ]  (an empty part: 0)

    opt = make_optimizer(cfg.optimizer, n, dtype, layers=chunk_tensors(model, layout, l))
    opt.norms = partial(shard_norms, comm, algorithm)  # 2 x (W, b) squared norms: one all-reduce

Every rank passes the same number of values (two tensors per layer, empty parts included), so
the all-reduce matches on every rank; the sums run in another order than one device's norm, so
the results agree to rounding (1e-16 relative), not to the bit.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.model import MLP
from dplab.reference.zero.layout import ShardLayout

__all__ = ["chunk_tensors", "shard_norms"]


def chunk_tensors(model: MLP, layout: ShardLayout, layer: int, whole: bool) -> list[slice]:
    """The slices of W_l and b_l inside this rank's chunk of ``layer`` (the whole layer if
    ``whole``), relative to that chunk; either may be empty.

    Args:
        model: the MLP.
        layout: who owns which chunk.
        layer: the layer.
        whole: take the whole layer (stage 0) instead of this rank's chunk.

    Returns:
        [W's slice, b's slice].
    """
    tensors = [model.param_slices[i] for i in model.layer_params(layer)]
    start = tensors[0].start
    w, b = (slice(s.start - start, s.stop - start) for s in tensors)
    own = slice(0, w.stop + (b.stop - b.start)) if whole else layout.own(layer)
    out = []
    for t in (w, b):
        lo = min(max(t.start, own.start), own.stop)  # clamped into the chunk: an empty part sits
        hi = max(min(t.stop, own.stop), lo)  # where it would start, so the parts tile the chunk
        out.append(slice(lo - own.start, hi - own.start))
    return out


def shard_norms(comm: Communicator, algorithm: str, arrays: list[np.ndarray]) -> list[float]:
    """The norms of the whole tensors whose chunks ``arrays`` are:
    one all-reduce of their squares.

    Args:
        comm: this rank's communicator.
        algorithm: the all-reduce to use.
        arrays: this rank's chunk of each tensor (possibly empty), the same count on every rank.

    Returns:
        Each whole tensor's 2-norm, the same on every rank.
    """
    squares = np.array([float(np.dot(a, a)) for a in arrays], dtype=np.float64)
    allreduce(comm, squares, algorithm)
    return [float(np.sqrt(s)) for s in squares]
