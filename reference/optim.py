"""SGD, momentum, Adam, LARS and LAMB on flat NumPy arrays (or torch tensors), formula for formula
like the papers and torch.optim; ``make_optimizer`` builds any of the five from an ``OptimConfig``.

LARS and LAMB take the model's tensors (``layers=``, one trust ratio each); the lr of update t
comes from ``cfg.lr`` and ``cfg.warmup_steps``. Updates are in place, with
``xp = array_namespace(params)`` (``device=`` keeps the state as torch tensors there).

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
from typing import Any, Literal

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError
from dplab.reference.lr import warmup_lr
from dplab.reference.model import array_namespace

__all__ = ["OptimConfig", "Optimizer", "SGD", "Momentum", "Adam", "LARS", "LAMB", "make_optimizer",
           "OPTIMIZERS", "LAYERWISE", "check_layers", "trust_ratio", "local_norms"]

OPTIMIZERS = ("sgd", "momentum", "adam", "lars", "lamb")
LAYERWISE = ("lars", "lamb")  # need ``layers=``: one trust ratio per tensor


@dataclass(frozen=True)
class OptimConfig:
    """``weight_decay`` is L2 added to the gradient, as torch.optim.SGD/Adam do (not AdamW);
    LARS and LAMB use it as their papers do (see ``LARS``, ``LAMB``).

    ``warmup_steps``: the lr ramps linearly over the first updates (``lr.warmup_lr``).
    ``trust_coef``: LARS's eta, the trust coefficient (0.001 in the paper): a tensor moves by
    about lr * eta of its norm per step, so LARS wants a much larger ``lr`` than SGD.

    Args:
        name: "sgd", "momentum", "adam", "lars" or "lamb".
        lr: the learning rate.
        momentum: momentum and LARS's m.
        betas: Adam's and LAMB's (b1, b2).
        eps: Adam's and LAMB's epsilon.
        weight_decay: L2 (decoupled in LARS and LAMB).
        warmup_steps: updates of linear warm-up (0: none).
        trust_coef: LARS's eta.
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
            raise ConfigError(f"optimizer name must be one of {', '.join(OPTIMIZERS)}, not "
                              f"{self.name!r}")
        if not self.lr >= 0 or not self.weight_decay >= 0 or not self.eps > 0:
            raise ConfigError(f"need lr >= 0, weight_decay >= 0 and eps > 0, got {self}")
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(
                f"warmup_steps must be an integer >= 0 (0: no warm-up), got {steps!r}"
            )
        if not (math.isfinite(self.trust_coef) and self.trust_coef > 0):
            raise ConfigError("trust_coef (LARS's eta) must be a finite number > 0, got "
                              f"{self.trust_coef}")
        if not 0 <= self.momentum < 1 or len(self.betas) != 2:
            raise ConfigError(f"need 0 <= momentum < 1 and two betas, got {self}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must lie in [0, 1), got {self.betas}")


class Optimizer:
    """Base class: checks shapes, counts steps, saves and restores its state arrays.

    Subclasses list their state arrays in ``_state_names`` and implement ``_update``, which
    reads the lr of this update from ``self.lr`` (warm-up applied). ``layers``: the model's
    tensors as slices of the flat vector (``MLP.param_slices``), for the layer-wise ones.
    ``device``: None keeps the state in numpy arrays; a torch device (``dtype`` a torch dtype,
    e.g. ``params.dtype``) keeps it in torch tensors there, for parameters that live there.

    Args:
        cfg: the hyperparameters.
        num_params: the flat parameter vector's length.
        dtype: the state's dtype (a torch dtype with ``device``).
        layers: the model's ``param_slices`` (LARS and LAMB need them).
        device: None for numpy state, or a torch device.
    """

    _state_names: tuple[str, ...] = ()
    _l2_in_grad = True  # add weight_decay * params to the gradient before _update

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None, device: Any = None):
        self.cfg, self.num_params, self.layers = cfg, num_params, layers
        self.t = 0  # number of steps taken (Adam's bias correction and the warm-up need it)
        if device is None:  # numpy arrays on the host
            self.dtype = np.dtype(dtype)
            state = [np.zeros(num_params, dtype=self.dtype) for _ in self._state_names]
        else:  # torch tensors on ``device``
            import torch

            self.dtype = dtype
            state = [torch.zeros(num_params, dtype=dtype, device=device) for _ in self._state_names]
        for name, zeros in zip(self._state_names, state, strict=True):
            setattr(self, name, zeros)

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """One update of ``params`` in place from ``grad`` (which is left untouched).

        Args:
            params: the flat parameters, updated in place.
            grad: their gradient.

        Raises:
            ConfigError: ``params`` or ``grad`` of another shape or dtype than the optimizer's.
        """
        for name, a in (("params", params), ("grad", grad)):
            if a.shape != (self.num_params,) or a.dtype != self.dtype:
                raise ConfigError(f"{name} must be {self.dtype} of shape ({self.num_params},), "
                                  f"got {a.dtype} {tuple(a.shape)}: build the optimizer to match")
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
        """Copies of the state: ``{"step": t, <array name>: array, ...}``.

        Returns:
            The step count and a copy of every state array.
        """
        return {"step": self.t, **{n: getattr(self, n).copy() for n in self._state_names}}

    def load_state_dict(self, state: dict[str, np.ndarray | int]) -> None:
        """Restore a ``state_dict()``; the continuation is then bitwise identical.

        Args:
            state: what ``state_dict()`` returned (copied in).

        Raises:
            ConfigError: missing or extra keys, or arrays of another model's size.
        """
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
        denom = array_namespace(v).sqrt(v) / math.sqrt(1 - b2**t) + self.cfg.eps
        params -= (self.lr / (1 - b1**t)) * m / denom


# LARS and LAMB: one learning rate per tensor, scaled by how large the tensor is.
#
# With a large global batch and a large lr, one lr for the whole model is too much for some
# layers and too little for others: the ratio ||w|| / ||g|| differs by orders of magnitude
# between layers (You et al. measured it on AlexNet), so the step that is right for one
# tensor blows up another. LARS and LAMB give each tensor a *trust ratio* so that its step
# is a fixed fraction of its own norm, whatever the scale of its gradient. "Tensor" here is
# each weight matrix and each bias vector of the MLP (``MLP.param_slices``), as the papers
# apply it per layer and their implementations per tensor.
#
# Both take ``layers=`` and refuse to run without it (which tensor is which cannot be
# guessed from a flat vector). The norms come from ``self.norms`` (a list of arrays -> their
# norms): here, ``local_norms``; when each rank holds only a chunk of every tensor (ZeRO), a
# function that all-reduces the chunks' squared norms, so every rank gets the whole tensors'.
# A tensor whose norm is 0 (a bias at initialisation), or whose update is 0, gets ratio 1, as
# in the reference implementations: the formula would give 0 or 0/0.


def local_norms(arrays: list[np.ndarray]) -> list[float]:
    """The 2-norm of each array (the whole tensors are here: one device, or a replica).

    Args:
        arrays: the tensors.

    Returns:
        Their 2-norms, as floats.
    """
    return [float(array_namespace(a).linalg.norm(a)) for a in arrays]


def check_layers(layers: list[slice] | None, num_params: int, who: str) -> tuple[slice, ...]:
    """The slices, checked to tile ``[0, num_params)`` in order: every parameter in one tensor.

    Args:
        layers: the slices, or None.
        num_params: the flat vector's length.
        who: the optimizer, for the message.

    Returns:
        The slices, as a tuple.

    Raises:
        ConfigError: None, or slices that do not tile ``[0, num_params)`` in order.
    """
    if layers is None:
        raise ConfigError(f"{who} keeps one trust ratio per tensor and needs layers=: pass the "
                          "model's param_slices, e.g. make_optimizer(cfg, model.num_params, dtype, "
                          "layers=model.param_slices)")
    layers, end = tuple(layers), 0
    for sl in layers:
        if (
            not isinstance(sl, slice)
            or sl.step not in (None, 1)
            or sl.start != end
            or sl.stop < end
        ):
            raise ConfigError(f"{who}'s layers must be slices that tile 0..{num_params} in order, "
                              f"got {sl!r} where one starting at {end} was due: pass "
                              "model.param_slices")
        end = sl.stop
    if end != num_params:
        raise ConfigError(f"{who}'s layers cover 0..{end} but there are {num_params} parameters: "
                          "pass the param_slices of the model being trained")
    return layers


def trust_ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, or 1 where either is 0 (the papers' implementations'
    convention).

    Args:
        numerator: e.g. the weight's norm.
        denominator: e.g. the update's norm.

    Returns:
        The ratio, or 1.0.
    """
    return numerator / denominator if numerator > 0 and denominator > 0 else 1.0


class LARS(Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman, Ginsburg 2017, Algorithm 1).

    For each tensor w with gradient g, weight decay beta, trust coefficient eta, momentum m
    and the global lr gamma_t (warm-up applied)::

        local_lr = eta * ||w|| / (||g|| + beta ||w||)          (1 if ||w|| or ||g|| is 0)
        v = m v + gamma_t * local_lr * (g + beta w)
        w = w - v

    as the MLPerf reference (TensorFlow LARS) implements it. torchlars keeps the lr outside
    the buffer (``v = m v + local_lr (g + beta w); w -= gamma_t v``): the same steps while
    the lr is constant, different ones during a warm-up. Many recipes also leave biases
    out of the trust ratio and weight decay; here every tensor gets both, as in the paper.

    Args:
        cfg: the hyperparameters.
        num_params: the flat parameter vector's length.
        dtype: the state's dtype.
        layers: the model's ``param_slices``.
        device: None for numpy state, or a torch device.

    Raises:
        ConfigError: ``layers`` missing, or not tiling the parameters.
    """

    _state_names = ("momentum_buffer",)
    _l2_in_grad = False  # weight decay enters local_lr and the update, not the gradient norm

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None, device: Any = None):
        super().__init__(cfg, num_params, dtype, check_layers(layers, num_params, "LARS"), device)
        self.norms = local_norms

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        cfg, lr, v = self.cfg, self.lr, self.momentum_buffer
        wd, k = cfg.weight_decay, len(self.layers)
        norms = self.norms([params[sl] for sl in self.layers] + [g[sl] for sl in self.layers])
        for sl, w_norm, g_norm in zip(self.layers, norms[:k], norms[k:], strict=True):
            w, gi = params[sl], g[sl]
            local_lr = (
                cfg.trust_coef * w_norm / (g_norm + wd * w_norm)
                if w_norm > 0 and g_norm > 0
                else 1.0
            )
            v[sl] *= cfg.momentum
            v[sl] += (lr * local_lr) * (gi + wd * w if wd else gi)
            w -= v[sl]  # a view: writes into params


class LAMB(Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019, Algorithm 2).

    Adam's bias-corrected step, plus decoupled weight decay lambda, scaled per tensor::

        m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
        r = m_hat / (sqrt(v_hat) + eps)       m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
        u = r + lambda w
        w = w - lr_t * phi(||w||) / ||u|| * u     (phi = identity; ratio 1 if ||w|| or ||u|| is 0)

    So each tensor moves by lr_t * ||w|| per step, in Adam's direction. ``eps`` is added
    after the bias correction of sqrt(v), as in ``Adam`` here and in the paper.

    Args:
        cfg: the hyperparameters.
        num_params: the flat parameter vector's length.
        dtype: the state's dtype.
        layers: the model's ``param_slices``.
        device: None for numpy state, or a torch device.

    Raises:
        ConfigError: ``layers`` missing, or not tiling the parameters.
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _l2_in_grad = False  # decoupled: lambda w joins Adam's direction, not the gradient

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None, device: Any = None):
        super().__init__(cfg, num_params, dtype, check_layers(layers, num_params, "LAMB"), device)
        self.norms = local_norms

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        (b1, b2), t, cfg = self.cfg.betas, self.t, self.cfg
        m, v = self.exp_avg, self.exp_avg_sq
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (array_namespace(v).sqrt(v) / math.sqrt(1 - b2**t) + cfg.eps)
        if cfg.weight_decay:
            u += cfg.weight_decay * params
        lr, k = self.lr, len(self.layers)
        norms = self.norms([params[sl] for sl in self.layers] + [u[sl] for sl in self.layers])
        for sl, w_norm, u_norm in zip(self.layers, norms[:k], norms[k:], strict=True):
            params[sl] -= (lr * trust_ratio(w_norm, u_norm)) * u[sl]


def make_optimizer(cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                   layers: list[slice] | None = None, device: Any = None) -> Optimizer:
    """The optimizer named by ``cfg.name``, with zeroed state of ``num_params`` in ``dtype``.

    ``layers`` (the model's ``param_slices``) is required by LARS and LAMB, ignored by the others.
    ``device``: None, numpy state; a torch device, torch state there (``dtype`` then a torch dtype).

    Args:
        cfg: the optimizer's name and hyperparameters.
        num_params: the flat parameter vector's length.
        dtype: the state's dtype.
        layers: the model's ``param_slices`` (LARS and LAMB).
        device: None, or a torch device.

    Returns:
        The optimizer.

    Raises:
        ConfigError: LARS or LAMB without valid ``layers``.
    """
    cls = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "lars": LARS, "lamb": LAMB}[cfg.name]
    return cls(cfg, num_params, dtype, layers, device)
