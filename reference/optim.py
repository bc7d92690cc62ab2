"""SGD, momentum and Adam on flat NumPy arrays, formula for formula like torch.optim.

Optimizers update the one flat parameter vector in place. In synchronous data parallelism
every rank runs the same optimizer on the same all-reduced gradient, so the states stay
identical without ever being communicated; the parameter server runs one on its own.

    >>> import numpy as np
    >>> from dplab.reference.optim import OptimConfig, make_optimizer
    >>> params, grad = np.ones(3), np.full(3, 0.5)
    >>> opt = make_optimizer(OptimConfig(name="momentum", lr=0.1), num_params=3)
    >>> opt.step(params, grad)
    >>> params
    array([0.95, 0.95, 0.95])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError

__all__ = ["OptimConfig", "Optimizer", "SGD", "Momentum", "Adam", "make_optimizer"]


@dataclass(frozen=True)
class OptimConfig:
    """``weight_decay`` is L2 added to the gradient, as torch.optim.SGD/Adam do (not AdamW)."""

    name: Literal["sgd", "momentum", "adam"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.name not in ("sgd", "momentum", "adam"):
            raise ConfigError(
                f"optimizer name must be 'sgd', 'momentum' or 'adam', not {self.name!r}"
            )
        if not self.lr >= 0 or not self.weight_decay >= 0 or not self.eps > 0:
            raise ConfigError(f"need lr >= 0, weight_decay >= 0 and eps > 0, got {self}")
        if not 0 <= self.momentum < 1 or len(self.betas) != 2:
            raise ConfigError(f"need 0 <= momentum < 1 and two betas, got {self}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must lie in [0, 1), got {self.betas}")


class Optimizer:
    """Base class: checks shapes, counts steps, saves and restores its state arrays.

    Subclasses list their state arrays in ``_state_names`` and implement ``_update``.
    """

    _state_names: tuple[str, ...] = ()

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64):
        self.cfg, self.num_params, self.dtype = cfg, num_params, np.dtype(dtype)
        self.t = 0  # number of steps taken (Adam's bias correction needs it)
        for name in self._state_names:
            setattr(self, name, np.zeros(num_params, dtype=self.dtype))

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """One update of ``params`` in place from ``grad`` (which is left untouched)."""
        for name, a in (("params", params), ("grad", grad)):
            if a.shape != (self.num_params,) or a.dtype != self.dtype:
                raise ConfigError(f"{name} must be {self.dtype} of shape ({self.num_params},), "
                                  f"got {a.dtype} {a.shape}: build the optimizer to match")
        self.t += 1
        wd = self.cfg.weight_decay
        self._update(params, grad + wd * params if wd else grad)

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray | int]:
        """Copies of the state: ``{"step": t, <array name>: array, ...}``."""
        return {"step": self.t, **{n: getattr(self, n).copy() for n in self._state_names}}

    def load_state_dict(self, state: dict[str, np.ndarray | int]) -> None:
        """Restore a ``state_dict()``; the continuation is then bitwise identical."""
        if set(state) != {"step", *self._state_names}:
            raise ConfigError(f"{type(self).__name__} state needs keys "
                              f"{['step', *self._state_names]}, got {sorted(state)}")
        for n in self._state_names:
            if np.shape(state[n]) != (self.num_params,):
                raise ConfigError(f"state {n!r} has shape {np.shape(state[n])}, expected "
                                  f"({self.num_params},): load a state of the same model")
        for n in self._state_names:
            getattr(self, n)[...] = state[n]  # copy in: the caller's arrays stay theirs
        self.t = int(state["step"])


class SGD(Optimizer):
    """``p -= lr * g``."""

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        params -= self.cfg.lr * g


class Momentum(Optimizer):
    """Heavy ball, as torch.optim.SGD(momentum=m, dampening=0, nesterov=False).

    ``buf = m * buf + g; p -= lr * buf``. torch starts ``buf`` as a copy of the first
    gradient; starting from zeros gives the same first value, ``m * 0 + g == g``, exactly.
    """

    _state_names = ("momentum_buffer",)

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        buf = self.momentum_buffer
        buf *= self.cfg.momentum
        buf += g
        params -= self.cfg.lr * buf


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected the way torch.optim.Adam does it::

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    Note eps is added AFTER the bias correction of sqrt(v), which is torch's choice.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        (b1, b2), t = self.cfg.betas, self.t
        m, v = self.exp_avg, self.exp_avg_sq
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        denom = np.sqrt(v) / math.sqrt(1 - b2**t) + self.cfg.eps
        params -= (self.cfg.lr / (1 - b1**t)) * m / denom


def make_optimizer(cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64) -> Optimizer:
    """The optimizer named by ``cfg.name``, with zeroed state of ``num_params`` in ``dtype``."""
    cls = {"sgd": SGD, "momentum": Momentum, "adam": Adam}[cfg.name]
    return cls(cfg, num_params, dtype)
