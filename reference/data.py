"""Synthetic data sets and the deterministic batching every trainer shares.

Data parallelism is only checkable if every run sees the same global batches: the
single-device oracle and each rank of a data-parallel run call ``batch_indices`` with the
same ``(n, global_batch, step, seed)``, and each rank keeps its ``shard`` of the result.

    >>> from dplab.reference.data import make_dataset, batch_indices, shard
    >>> data = make_dataset("regression", n=10, in_dim=3, out_dim=2, seed=0)
    >>> idx = batch_indices(10, global_batch=4, step=0, seed=0)
    >>> [len(shard(idx, rank, world_size=3)) for rank in range(3)]
    [2, 1, 1]
    >>> x, y = data.x[idx], data.y[idx]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds

__all__ = ["Dataset", "make_dataset", "batch_indices", "shard"]

# Stream tag for the data generator. A spawn key keeps it independent of
# ``default_rng(seed)`` (model init) and of ``default_rng([seed, e])`` (epoch e's
# permutation). Without it they would collide: default_rng(s) == default_rng([s, 0]),
# and a teacher drawn from the same stream as the student's init starts them aligned.
_DATA_STREAM = 0xDA7A


@dataclass(frozen=True)
class Dataset:
    """``x``: (n, in_dim). ``y``: (n, out_dim) floats (regression) or (n,) int64 labels.

    Args:
        x: the inputs.
        y: the targets.
    """

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


def make_dataset(
    kind: Literal["regression", "classification"], n: int, in_dim: int, out_dim: int,
    seed: int, dtype: DTypeLike = np.float64,
) -> Dataset:
    """A learnable synthetic data set, deterministic from ``seed``.

    regression: ``y = tanh(x A) B + 0.05 * noise`` for a random "teacher" (A, B), so an MLP
    can drive the loss far down but not to zero. classification: ``label = argmax(x W)`` for a
    random teacher W, a linearly separable problem with ``out_dim`` classes.

    Args:
        kind: "regression" or "classification".
        n: the number of samples.
        in_dim: features per sample.
        out_dim: targets per sample (regression) or classes (classification).
        seed: the data's seed (>= 0).
        dtype: the inputs' dtype (and the regression targets').

    Returns:
        (x, y): y float for regression, int64 labels for classification.

    Raises:
        ConfigError: a size < 1, a negative seed, fewer than 2 classes, or an unknown kind.
    """
    if n < 1 or in_dim < 1 or out_dim < 1:
        raise ConfigError(
            f"make_dataset needs n, in_dim, out_dim >= 1, got {n}, {in_dim}, {out_dim}"
        )
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_DATA_STREAM,)))
    x = rng.standard_normal((n, in_dim))
    if kind == "regression":
        width = 2 * in_dim
        a = rng.standard_normal((in_dim, width)) / np.sqrt(in_dim)
        b = rng.standard_normal((width, out_dim)) / np.sqrt(width)
        y = np.tanh(x @ a) @ b + 0.05 * rng.standard_normal((n, out_dim))
        return Dataset(x.astype(dtype), y.astype(dtype))
    if kind == "classification":
        if out_dim < 2:
            raise ConfigError("classification needs out_dim >= 2 classes")
        w = rng.standard_normal((in_dim, out_dim))
        return Dataset(x.astype(dtype), np.argmax(x @ w, axis=1).astype(np.int64))
    raise ConfigError(f"kind must be 'regression' or 'classification', not {kind!r}")


def batch_indices(n: int, global_batch: int, step: int, seed: int) -> np.ndarray:
    """Indices of the global batch of ``step``: a walk through shuffled epochs.

    Epoch e is the permutation ``default_rng([seed, e]).permutation(n)``; the stream of all
    epochs laid end to end is cut into consecutive pieces of ``global_batch``, so a batch
    may straddle an epoch boundary, and a batch larger than n spans several epochs (indices
    repeat). Computed from ``step`` alone, with no hidden iterator state: any rank can jump
    to any step, and a resumed run sees the same batches.

    >>> batch_indices(4, global_batch=3, step=1, seed=0).shape
    (3,)

    Args:
        n: the data set's size.
        global_batch: samples per step.
        step: the step.
        seed: the shuffle's seed.

    Returns:
        ``global_batch`` int64 indices into the data set.

    Raises:
        ConfigError: n or global_batch < 1, or a negative step or seed.
    """
    if n < 1 or global_batch < 1:
        raise ConfigError(
            f"batch_indices needs n >= 1 and global_batch >= 1, got {n}, {global_batch}"
        )
    if step < 0 or seed < 0:
        raise ConfigError(f"step and seed must be >= 0, got step={step}, seed={seed}")
    epoch, offset = divmod(step * global_batch, n)
    pieces, remaining = [], global_batch
    while remaining > 0:
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        piece = perm[offset : offset + remaining]
        pieces.append(piece)
        remaining -= len(piece)
        epoch, offset = epoch + 1, 0
    return np.concatenate(pieces).astype(np.int64)


def shard(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank's contiguous piece of the global batch; the first ``len % world_size`` get one more.

    Shards may be empty (global batch smaller than world_size). That is fine: the model's
    loss is scaled by ``1 / global_batch``, not by the shard size, so an empty shard
    contributes an exact zero and the shards' gradients still sum to the full-batch one.

    Args:
        indices: the global batch's indices.
        rank: this rank.
        world_size: the number of ranks.

    Returns:
        A view of this rank's indices.

    Raises:
        ConfigError: rank out of range.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    start, stop = chunk_bounds(len(indices), world_size)[rank]
    return indices[start:stop]
