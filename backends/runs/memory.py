"""What a training run holds in memory on this host, estimated before any rank starts.

    need = train_need(RunSpec(world_size=4))     # world size -> (bytes, of which /dev/shm, words)
    check_run(spec)                              # WorldTooLarge, in one line, if it cannot fit

Every rank of a world started here holds its replica (weights, gradients, optimizer state; under
ZeRO its shards and a gathered layer), the whole synthetic data set (each rank makes it from the
seed), one step's batch indices and activations; the launcher then holds every rank's parameters,
the loss over the whole data set and the single-device run the result is checked against. The
sum, with what the ranks themselves cost (``dplab.backends.launch.limits``), is compared with the
memory available: ``--hidden 100000000`` (2.1 G parameters, 84 GB a replica with Adam) or
``--global-batch 1000000000`` is refused with how much too much it is, before a rank starts.

The estimate counts the arrays the code makes, each term a little above what numpy allocates
(temporaries of the data generator and of a layer's backward included), so a run it lets through
fits; what it misses is Python's own objects, a few MiB. On a GPU the model and the activations
live in the device's memory, which is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.backends.launch.limits import Extra, WorldNeed, check_world
from dplab.backends.registry import entry
from dplab.reference.files import size_text
from dplab.reference.model import MLP
from dplab.reference.zero.memory import OPTIMIZER_STATES, model_state_bytes

__all__ = ["TrainBytes", "train_bytes", "train_need", "check_run", "activation_bytes",
           "gathered_bytes"]


@dataclass(frozen=True)
class TrainBytes:
    """Bytes of one run at one world size."""

    replica: int  # one rank's model state: weights, gradients, optimizer state (shards under ZeRO)
    data: int  # the data set, as made from the seed (with its generator's temporaries)
    step: int  # one rank's batch indices and activations for one micro-batch
    launcher: int  # the launcher's: every rank's result, then the checks over the whole data set
    shm: int  # of one rank's bytes, those in /dev/shm (the local backend's gradient buffer)

    def rank(self) -> int:
        return self.replica + self.data + self.step

    def total(self, world_size: int) -> int:
        return world_size * self.rank() + self.launcher


def activation_bytes(spec: Any, world_size: int) -> int:
    """One rank's activations kept for backward, and its deltas, for one micro-batch of ``spec``
    (a ``RunSpec``) on ``world_size`` ranks."""
    cfg = spec.train
    item = np.dtype(cfg.dtype).itemsize
    widths = cfg.model.in_dim + sum(cfg.model.hidden) + cfg.model.out_dim
    micro = -(-cfg.global_batch // world_size) // spec.accum_steps + 1
    return 3 * micro * widths * item


def gathered_bytes(spec: Any) -> int:
    """Under ZeRO, the largest layer gathered whole, and its gradient, beside the shards."""
    if spec.zero_stage is None:
        return 0
    model = MLP(spec.train.model)
    largest = max(int(np.prod(s)) for s in model.param_shapes) if model.param_shapes else 0
    return 2 * largest * np.dtype(spec.train.dtype).itemsize


def train_bytes(spec: Any, world_size: int) -> TrainBytes:
    """What ``spec`` (a ``RunSpec``) holds on ``world_size`` ranks (module docstring)."""
    cfg, model = spec.train, MLP(spec.train.model)
    n, item = model.num_params, np.dtype(cfg.dtype).itemsize
    widths = cfg.model.in_dim + sum(cfg.model.hidden) + cfg.model.out_dim
    states = OPTIMIZER_STATES[cfg.optimizer.name]
    half = 2 * 2 * n if spec.precision is not None else 0  # float16 copies of weights and gradients
    if spec.zero_stage is not None:
        shards = model_state_bytes(n, spec.zero_stage, world_size, param_bytes=item,
                                   grad_bytes=item, state_bytes=states * item)
        replica = int(shards.total) + gathered_bytes(spec) + half
    else:
        replica = (2 + states) * n * item + half
    replica += 8 * n  # the first weights are drawn in float64, then cast
    samples, m = cfg.num_samples, cfg.model
    data = samples * 8 * (6 * m.in_dim + 4 * m.out_dim)  # x, teacher outputs and their casts
    indices = 8 * (3 * cfg.global_batch + samples)  # each rank draws the whole batch, keeps a shard
    step = indices + activation_bytes(spec, world_size)
    oracle = (3 + states) * n * item + data + indices + 3 * cfg.global_batch * widths * item
    launcher = 2 * world_size * n * item + max(oracle, data + 3 * samples * widths * item)
    shm = n * item if entry(spec.backend).shared_memory else 0
    return TrainBytes(replica, data, step, launcher, shm)


def train_need(spec: Any) -> Extra:
    """``limits.Extra`` of ``spec``: world size -> (bytes, of which /dev/shm, in words)."""
    on_gpu = spec.on_gpu()

    def extra(p: int) -> tuple[int, int, str]:
        b = train_bytes(spec, p)
        if on_gpu:  # the replica and the activations are the GPU's: the host holds the data
            b = TrainBytes(0, b.data, 0, b.launcher, 0)
        words = (f"the run's arrays: a replica of {size_text(b.replica)}, the data set of "
                 f"{size_text(b.data)} and a step of {size_text(b.step)} on each rank, "
                 f"{size_text(b.launcher)} in the launcher")
        return b.total(p) - p * b.shm, p * b.shm, words

    return extra


def check_run(spec: Any) -> WorldNeed:
    """Refuse ``spec`` (a ``RunSpec``) in one line (``WorldTooLarge``) if its world and its arrays
    cannot fit here; the fix names what weighs most on a rank: the model, the batch or the data."""
    b = train_bytes(spec, max(spec.world_size, 1))  # (check_world refuses a world size < 1)
    fix = max((b.replica, "use a smaller model (--hidden, --in-dim)"),
              (b.step, "use a smaller --global-batch or more --accum-steps"),
              (b.data, "use a smaller --num-samples"))[1]
    return check_world(spec.backend, spec.world_size, train_need(spec), fix=fix)
