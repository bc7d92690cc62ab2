"""Hypothesis strategies shared by the training property tests (sync, async), and
``one_at_a_time`` for the builders that seed torch."""

from __future__ import annotations

import functools
import threading

from hypothesis import strategies as st

from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig

__all__ = ["train_configs", "one_at_a_time", "seed_torch"]

_TORCH_RNG = threading.Lock()


def seed_torch(seed: int) -> None:
    """``torch.manual_seed`` for the CPU's generator alone. ``torch.manual_seed`` seeds CUDA's too,
    which on a GPU machine starts CUDA in the test process (seen with torch 2.11 on an H200), and
    then no world forked after it can use the GPU."""
    import torch

    torch.default_generator.manual_seed(seed)


def one_at_a_time(make):
    """For a builder that seeds torch's global generator and draws from it: ranks that are threads
    (the cuda backend) share that one generator, so they build one at a time."""
    @functools.wraps(make)
    def build(*args, **kwargs):
        with _TORCH_RNG:
            return make(*args, **kwargs)

    return build


@st.composite
def train_configs(draw, dtype: str = "float64", steps: tuple[int, int] = (1, 4)) -> TrainConfig:
    """Small random models, data sets, optimizers and global batches (often < p or not
    divisible)."""
    dataset = draw(st.sampled_from(["regression", "classification"]))
    model = MLPConfig(
        in_dim=draw(st.integers(1, 6)),
        hidden=tuple(draw(st.lists(st.integers(1, 12), max_size=3))),
        out_dim=draw(st.integers(2 if dataset == "classification" else 1, 5)),
        activation=draw(st.sampled_from(["tanh", "relu"])),
        loss="xent" if dataset == "classification" else "mse",
    )
    name = draw(st.sampled_from(["sgd", "momentum", "adam"]))
    # Adam moves a coordinate by about lr * g / (|g| + eps): where a gradient cancels to ~0,
    # float32's
    # rounding of the sum (~1e-7 of its terms, far above eps = 1e-8) decides the step, so two orders
    # of addition legitimately end lr apart (a dead relu unit did: 2e-4 relative). In float32 the
    # comparison with one device uses an eps above that noise; float64's rounding is below 1e-8.
    eps = 1e-4 if dtype == "float32" else 1e-8
    return TrainConfig(
        model=model,
        dataset=dataset,
        num_samples=draw(st.integers(1, 40)),
        global_batch=draw(st.integers(1, 24)),
        steps=draw(st.integers(*steps)),
        optimizer=OptimConfig(name=name, lr=0.01 if name == "adam" else 0.05, eps=eps),
        seed=draw(st.integers(0, 2**16)),
        dtype=dtype,
    )
