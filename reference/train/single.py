"""Training configuration and the single-device trainer: the ground truth.

Every data-parallel run is judged by how close its parameters come to ``train_single`` on the
same ``TrainConfig``, so this file is kept plain: one model, one flat vector, one batch a step.

    python -m dplab.reference.train.single     # trains the default config, prints the loss per step

    >>> from dplab.reference.train.single import TrainConfig, train_single, evaluate
    >>> result = train_single(TrainConfig(steps=3))
    >>> len(result.losses)
    3

``train_single(cfg, device=torch.device("cuda"))`` computes on that device; the parameters come
back as a NumPy array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from dplab.reference.data import Dataset, batch_indices, make_dataset
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig, array_namespace
from dplab.reference.optim import OptimConfig, make_optimizer

__all__ = ["TrainConfig", "TrainResult", "setup", "on_device", "on_host", "train_single",
           "evaluate", "check_finite"]

_LOSS_OF = {"regression": "mse", "classification": "xent"}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run, bit for bit.

    Validation is an explicit ``validate()`` (called by ``setup``) rather than on
    construction, so ``dataclasses.replace`` can change ``dataset`` and ``model.loss`` one
    at a time without tripping over the half-changed config in between.

    Args:
        model: the MLP's shape.
        dataset: "regression" (mse) or "classification" (xent).
        num_samples: the data set's size.
        global_batch: samples per step, over all ranks.
        steps: the number of steps.
        optimizer: the optimizer and its hyperparameters.
        seed: seeds the data, the weights and the batches.
        dtype: "float64" or "float32".
    """

    model: MLPConfig = MLPConfig()
    dataset: Literal["regression", "classification"] = "regression"  # mse | xent respectively
    num_samples: int = 256
    global_batch: int = 32
    steps: int = 10
    optimizer: OptimConfig = OptimConfig()
    seed: int = 0
    dtype: str = "float64"  # "float64" | "float32"

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the field to change; return None if the config is fine."""
        if self.dataset not in _LOSS_OF:
            raise ConfigError(
                f"dataset must be 'regression' or 'classification', not {self.dataset!r}"
            )
        if self.model.loss != _LOSS_OF[self.dataset]:
            raise ConfigError(
                f"dataset {self.dataset!r} needs model.loss={_LOSS_OF[self.dataset]!r}, got "
                f"{self.model.loss!r}: use regression with 'mse' or classification with 'xent'"
            )
        if self.dataset == "classification" and self.model.out_dim < 2:
            raise ConfigError("classification needs model.out_dim >= 2 (the number of classes)")
        for name, least in (("num_samples", 1), ("global_batch", 1), ("steps", 0), ("seed", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.dtype not in ("float64", "float32"):
            raise ConfigError(f"dtype must be 'float64' or 'float32', not {self.dtype!r}")


@dataclass
class TrainResult:
    """What a trainer returns.

    Args:
        params: the final flat parameters.
        losses: each step's global-batch loss, before its update.
    """
    params: np.ndarray  # final flat parameters
    losses: list[float] = field(default_factory=list)  # each step's global-batch loss, pre-update


def setup(cfg: TrainConfig, device: Any = None, rank: int = 0) -> tuple[MLP, Dataset, Any]:
    """Model, data set and initial parameters: shared by every trainer so all start identically.

    The data set and the initial weights both come from ``cfg.seed`` but from independent
    random streams (see ``dplab.reference.data``), so the student does not start aligned with
    the teacher that made the data. ``rank`` > 0 draws other weights (``cfg.seed + 1 + rank``):
    a data-parallel run must broadcast rank 0's. ``device``: the data set and the weights as
    torch tensors there, copied once (``on_device``); None: NumPy arrays on the host.

    Args:
        cfg: the run's configuration.
        device: None for NumPy arrays; a torch device for tensors there.
        rank: this rank (0 draws the weights every data-parallel run broadcasts).

    Returns:
        (model, dataset, initial parameters).

    Raises:
        ConfigError: ``cfg`` is invalid (``TrainConfig.validate``).
    """
    cfg.validate()
    model = MLP(cfg.model)
    m = cfg.model
    data = make_dataset(cfg.dataset, cfg.num_samples, m.in_dim, m.out_dim, cfg.seed, cfg.dtype)
    params = model.init_params(cfg.seed if rank == 0 else cfg.seed + 1 + rank, dtype=cfg.dtype)
    return (
        model,
        Dataset(on_device(device, data.x), on_device(device, data.y)),
        on_device(device, params),
    )


def on_device(device: Any, a: np.ndarray) -> Any:
    """``a`` as a torch tensor on ``device`` (a copy; on the CPU, one that shares ``a``'s memory);
    with None, ``a`` itself. The model and the optimizers compute wherever their arrays live.

    Args:
        device: a torch device, or None.
        a: the array.

    Returns:
        A tensor on ``device``, or ``a``.
    """
    if device is None:
        return a
    import torch

    return torch.from_numpy(a).to(device)


def on_host(params: Any) -> np.ndarray:
    """``params`` as a NumPy array (a torch tensor is copied back from its device).

    Args:
        params: a NumPy array or a torch tensor.

    Returns:
        A NumPy array.
    """
    return params if isinstance(params, np.ndarray) else params.cpu().numpy()


def train_single(cfg: TrainConfig, device: Any = None) -> TrainResult:
    """The single-device oracle: per step, one global batch, one gradient, one update.

    ``scale = 1 / global_batch`` makes the loss the mean over the batch; data-parallel
    ranks use the same scale on their shards, so their gradients sum to this one.
    ``device``: None computes in NumPy; a torch device, with torch tensors there.

    Args:
        cfg: the run's configuration.
        device: None, or a torch device to compute on.

    Returns:
        The final parameters (a NumPy array) and each step's loss.

    Raises:
        ConfigError: ``cfg`` is invalid.
    """
    model, data, params = setup(cfg, device)
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices, device)
    grad = array_namespace(params).zeros_like(params)
    losses = []
    for step in range(cfg.steps):
        idx = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        grad[:] = 0
        loss, _ = model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / cfg.global_batch, grad)
        opt.step(params, grad)
        losses.append(loss)
    return TrainResult(on_host(params), losses)


def evaluate(cfg: TrainConfig, params: np.ndarray) -> float:
    """Mean per-sample loss of ``params`` over the whole data set.

    Args:
        cfg: the configuration that made the data set.
        params: the parameters to judge.

    Returns:
        The mean loss.
    """
    model, data, _ = setup(cfg)
    return model.loss(model.forward(params, data.x), data.y, scale=1 / cfg.num_samples)


def check_finite(params: np.ndarray, losses: list[float], ended: bool = True) -> None:
    """ConfigError if ``params`` hold inf or nan, or the run ``ended`` on a non-finite loss (only
    the last counts: a step that loss scaling skipped did not move the weights, and torch's
    GradScaler goes on).

    Args:
        params: the parameters after the last update.
        losses: each step's global loss so far.
        ended: whether the run is over (a non-finite last loss then counts).

    Raises:
        ConfigError: naming the step and what to do (lower the learning rate).
    """
    step = len(losses) - 1
    if not array_namespace(params).isfinite(params).all():
        # where it showed
        first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        when = (
            f"the loss was {losses[step]:.3g}"
            if first is None
            else f"the loss turned {losses[first]} at step {first}"
        )
        raise ConfigError(f"step {step}: the parameters are inf or nan after the update ({when}): "
                          "the run diverged; lower the learning rate")
    if ended and losses and not math.isfinite(losses[-1]):
        raise ConfigError(f"step {step}: the loss of the last step is {losses[-1]}: the run "
                          "diverged; lower the learning rate")


if __name__ == "__main__":
    cfg = TrainConfig()
    result = train_single(cfg)
    for step, loss in enumerate(result.losses):
        print(f"step {step:3d}  loss {loss:.6f}")
    print(f"final mean loss over {cfg.num_samples} samples: {evaluate(cfg, result.params):.6f}")
