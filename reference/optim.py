"""SGD, momentum and Adam on flat NumPy arrays, formula for formula like torch.optim.

LARS and LAMB, which need the model's tensors (one trust ratio each), are in
``optim_layerwise.py``; ``make_optimizer`` builds all five. Every optimizer takes the lr of
update t from ``cfg.lr`` and ``cfg.warmup_steps`` (``dplab.reference.lr.warmup_lr``).

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
from dplab.reference.lr import warmup_lr

__all__ = ["OptimConfig", "Optimizer", "SGD", "Momentum", "Adam", "make_optimizer", "OPTIMIZERS",
           "LAYERWISE"]

OPTIMIZERS = ("sgd", "momentum", "adam", "lars", "lamb")
LAYERWISE = ("lars", "lamb")  # need ``layers=``: one trust ratio per tensor


@dataclass(frozen=True)
class OptimConfig:
    """``weight_decay`` is L2 added to the gradient, as torch.optim.SGD/Adam do (not AdamW);
    LARS and LAMB use it as their papers do (see ``optim_layerwise``).

    ``warmup_steps``: the lr ramps linearly over the first updates (``lr.warmup_lr``).
    ``trust_coef``: LARS's eta, the trust coefficient (0.001 in the paper): a tensor moves by
    about lr * eta of its norm per step, so LARS wants a much larger ``lr`` than SGD.
    """

    name: Literal["sgd", "momentum", "adam", "lars", "lamb"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.9  # momentum and lars
    betas: tuple[float, float] = (0.9, 0.999)  # adam and lamb
    eps: float = 1e-8  # adam and lamb
    weight_decay: float = 0.0
    warmup_steps: int = 0
    trust_coef: float = 0.001  # lars

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optimizer name must be one of {', '.join(OPTIMIZERS)}, not {self.name!r}")
        if not self.lr >= 0 or not self.weight_decay >= 0 or not self.eps > 0:
            raise ConfigError(f"need lr >= 0, weight_decay >= 0 and eps > 0, got {self}")
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0 (0: no warm-up), got {steps!r}")
        if not (math.isfinite(self.trust_coef) and self.trust_coef > 0):
            raise ConfigError(f"trust_coef (LARS's eta) must be a finite number > 0, got {self.trust_coef}")
        if not 0 <= self.momentum < 1 or len(self.betas) != 2:
            raise ConfigError(f"need 0 <= momentum < 1 and two betas, got {self}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must lie in [0, 1), got {self.betas}")


class Optimizer:
    """Base class: checks shapes, counts steps, saves and restores its state arrays.

    Subclasses list their state arrays in ``_state_names`` and implement ``_update``, which
    reads the lr of this update from ``self.lr`` (warm-up applied). ``layers``: the model's
    tensors as slices of the flat vector (``MLP.param_slices``), for the layer-wise ones.
    """

    _state_names: tuple[str, ...] = ()
    _l2_in_grad = True  # add weight_decay * params to the gradient before _update

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None):
        self.cfg, self.num_params, self.dtype = cfg, num_params, np.dtype(dtype)
        self.layers = layers
        self.t = 0  # number of steps taken (Adam's bias correction and the warm-up need it)
        for name in self._state_names:
            setattr(self, name, np.zeros(num_params, dtype=self.dtype))

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """One update of ``params`` in place from ``grad`` (which is left untouched)."""
        for name, a in (("params", params), ("grad", grad)):
            if a.shape != (self.num_params,) or a.dtype != self.dtype:
                raise ConfigError(f"{name} must be {self.dtype} of shape ({self.num_params},), "
                                  f"got {a.dtype} {a.shape}: build the optimizer to match")
        self.t += 1
        wd = self.cfg.weight_decay if self._l2_in_grad else 0.0
        self._update(params, grad + wd * params if wd else grad)

    @property
    def lr(self) -> float:
        """The lr of the update being taken (number ``self.t``): ``cfg.lr`` after the warm-up."""
        return warmup_lr(self.cfg.lr, self.cfg.warmup_steps, self.t)

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
        params -= self.lr * g


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
        params -= self.lr * buf


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
        params -= (self.lr / (1 - b1**t)) * m / denom


def make_optimizer(cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                   layers: list[slice] | None = None) -> Optimizer:
    """The optimizer named by ``cfg.name``, with zeroed state of ``num_params`` in ``dtype``.

    ``layers`` (the model's ``param_slices``) is required by LARS and LAMB, ignored by the others.
    """
    from dplab.reference.optim_layerwise import LAMB, LARS  # it imports this module

    cls = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "lars": LARS, "lamb": LAMB}[cfg.name]
    return cls(cfg, num_params, dtype, layers)
