"""LARS and LAMB: one learning rate per tensor, scaled by how large the tensor is.

With a large global batch and a large lr, one lr for the whole model is too much for some
layers and too little for others: the ratio ||w|| / ||g|| differs by orders of magnitude
between layers (You et al. measured it on AlexNet), so the step that is right for one
tensor blows up another. LARS and LAMB give each tensor a *trust ratio* so that its step
is a fixed fraction of its own norm, whatever the scale of its gradient. "Tensor" here is
each weight matrix and each bias vector of the MLP (``MLP.param_slices``), as the papers
apply it per layer and their implementations per tensor.

    >>> import numpy as np
    >>> from dplab.reference.optim import OptimConfig, make_optimizer
    >>> params, grad = np.array([3.0, 4.0, 0.0]), np.array([0.3, 0.4, 1.0])
    >>> layers = [slice(0, 2), slice(2, 3)]     # a "weight" of norm 5, a zero "bias"
    >>> opt = make_optimizer(OptimConfig("lars", lr=1.0, trust_coef=0.01), 3, layers=layers)
    >>> opt.step(params, grad)    # weight: lr * eta = 1% of its norm; bias: ratio 1, an SGD step
    >>> np.round(params, 6)
    array([ 2.97,  3.96, -1.  ])

Both take ``layers=`` and refuse to run without it (which tensor is which cannot be
guessed from a flat vector). The norms come from ``self.norms`` (a list of arrays -> their
norms): here, ``local_norms``; when each rank holds only a chunk of every tensor (ZeRO), a
function that all-reduces the chunks' squared norms, so every rank gets the whole tensors'.
A tensor whose norm is 0 (a bias at initialisation), or whose update is 0, gets ratio 1, as
in the reference implementations: the formula would give 0 or 0/0.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError
from dplab.reference.optim import OptimConfig, Optimizer

__all__ = ["LARS", "LAMB", "check_layers", "trust_ratio", "local_norms"]


def local_norms(arrays: list[np.ndarray]) -> list[float]:
    """The 2-norm of each array (the whole tensors are here: one device, or a replica)."""
    return [float(np.linalg.norm(a)) for a in arrays]


def check_layers(layers: list[slice] | None, num_params: int, who: str) -> tuple[slice, ...]:
    """The slices, checked to tile ``[0, num_params)`` in order: every parameter in one tensor."""
    if layers is None:
        raise ConfigError(f"{who} keeps one trust ratio per tensor and needs layers=: pass the model's "
                          "param_slices, e.g. make_optimizer(cfg, model.num_params, dtype, "
                          "layers=model.param_slices)")
    layers, end = tuple(layers), 0
    for sl in layers:
        if not isinstance(sl, slice) or sl.step not in (None, 1) or sl.start != end or sl.stop < end:
            raise ConfigError(f"{who}'s layers must be slices that tile 0..{num_params} in order, "
                              f"got {sl!r} where one starting at {end} was due: pass model.param_slices")
        end = sl.stop
    if end != num_params:
        raise ConfigError(f"{who}'s layers cover 0..{end} but there are {num_params} parameters: "
                          "pass the param_slices of the model being trained")
    return layers


def trust_ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, or 1 where either is 0 (the papers' implementations' convention)."""
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
    """

    _state_names = ("momentum_buffer",)
    _l2_in_grad = False  # weight decay enters local_lr and the update, not the gradient norm

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None):
        super().__init__(cfg, num_params, dtype, check_layers(layers, num_params, "LARS"))
        self.norms = local_norms

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        cfg, lr, v = self.cfg, self.lr, self.momentum_buffer
        wd, k = cfg.weight_decay, len(self.layers)
        norms = self.norms([params[sl] for sl in self.layers] + [g[sl] for sl in self.layers])
        for sl, w_norm, g_norm in zip(self.layers, norms[:k], norms[k:], strict=True):
            w, gi = params[sl], g[sl]
            local_lr = cfg.trust_coef * w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
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
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _l2_in_grad = False  # decoupled: lambda w joins Adam's direction, not the gradient

    def __init__(self, cfg: OptimConfig, num_params: int, dtype: DTypeLike = np.float64,
                 layers: list[slice] | None = None):
        super().__init__(cfg, num_params, dtype, check_layers(layers, num_params, "LAMB"))
        self.norms = local_norms

    def _update(self, params: np.ndarray, g: np.ndarray) -> None:
        (b1, b2), t, cfg = self.cfg.betas, self.t, self.cfg
        m, v = self.exp_avg, self.exp_avg_sq
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (np.sqrt(v) / math.sqrt(1 - b2**t) + cfg.eps)
        if cfg.weight_decay:
            u += cfg.weight_decay * params
        lr, k = self.lr, len(self.layers)
        norms = self.norms([params[sl] for sl in self.layers] + [u[sl] for sl in self.layers])
        for sl, w_norm, u_norm in zip(self.layers, norms[:k], norms[k:], strict=True):
            params[sl] -= (lr * trust_ratio(w_norm, u_norm)) * u[sl]
