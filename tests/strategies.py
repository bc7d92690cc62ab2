"""Hypothesis strategies shared by the training property tests (sync, async)."""

from __future__ import annotations

from hypothesis import strategies as st

from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig

__all__ = ["train_configs"]


@st.composite
def train_configs(draw, dtype: str = "float64", steps: tuple[int, int] = (1, 4)) -> TrainConfig:
    """Small random models, data sets, optimizers and global batches (often < p or not divisible)."""
    dataset = draw(st.sampled_from(["regression", "classification"]))
    model = MLPConfig(
        in_dim=draw(st.integers(1, 6)),
        hidden=tuple(draw(st.lists(st.integers(1, 12), max_size=3))),
        out_dim=draw(st.integers(2 if dataset == "classification" else 1, 5)),
        activation=draw(st.sampled_from(["tanh", "relu"])),
        loss="xent" if dataset == "classification" else "mse",
    )
    name = draw(st.sampled_from(["sgd", "momentum", "adam"]))
    return TrainConfig(model=model, dataset=dataset, num_samples=draw(st.integers(1, 40)),
                       global_batch=draw(st.integers(1, 24)), steps=draw(st.integers(*steps)),
                       optimizer=OptimConfig(name=name, lr=0.01 if name == "adam" else 0.05),
                       seed=draw(st.integers(0, 2**16)), dtype=dtype)
