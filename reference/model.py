"""An MLP with a hand-written backward that hands out gradients layer by layer, in NumPy or torch.

All parameters live in ONE flat vector ``[W0, b0, W1, b1, ...]``, so ``layer_slice(l)`` is one
contiguous range a trainer can ship as soon as it is ready.

    >>> import numpy as np
    >>> from dplab.reference.model import MLP, MLPConfig
    >>> model = MLP(MLPConfig(in_dim=3, hidden=(5,), out_dim=2))
    >>> params = model.init_params(seed=0)
    >>> x, y = np.ones((4, 3)), np.zeros((4, 2))
    >>> loss, grad = model.loss_and_grad(params, x, y, scale=1 / 4)
    >>> grad.shape == params.shape == (model.num_params,)
    True

The backward is a generator, so communication can overlap computation::

    grad[:] = 0
    acts = model.forward(params, x)
    for layer in model.backward(params, acts, y, grad, scale=1 / global_batch):
        launch_allreduce(grad[model.layer_slice(layer)])   # layers L-1, ..., 0

Every method computes with ``xp = array_namespace(params)``: numpy arrays or torch tensors alike.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
from numpy.typing import DTypeLike

from dplab.reference.errors import ConfigError

__all__ = ["MLPConfig", "MLP", "array_namespace"]


def array_namespace(a: Any) -> ModuleType:
    """The library ``a`` comes from: ``numpy`` for a numpy array, ``torch`` for a torch tensor.

    Read off the type's module, so this file never imports torch itself.

    Args:
        a: a numpy array or torch tensor.

    Returns:
        The module: ``numpy`` or ``torch``.
    """
    return sys.modules[type(a).__module__.partition(".")[0]]


@dataclass(frozen=True)
class MLPConfig:
    """Shape of the network. ``loss="xent"`` is softmax cross-entropy on integer labels.

    Args:
        in_dim: features per sample.
        hidden: the hidden layers' widths.
        out_dim: outputs per sample (classes, for xent).
        activation: "tanh" or "relu".
        loss: "mse" or "xent".
    """

    in_dim: int = 8
    hidden: tuple[int, ...] = (16, 16)
    out_dim: int = 4
    activation: Literal["tanh", "relu"] = "tanh"
    loss: Literal["mse", "xent"] = "mse"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))  # accept lists, stay hashable
        dims = (self.in_dim, *self.hidden, self.out_dim)
        if any(int(d) != d or d < 1 for d in dims):
            raise ConfigError(f"MLPConfig: every width must be an integer >= 1, got {dims}")
        if self.activation not in ("tanh", "relu"):
            raise ConfigError(
                f"MLPConfig.activation must be 'tanh' or 'relu', not {self.activation!r}"
            )
        if self.loss not in ("mse", "xent"):
            raise ConfigError(f"MLPConfig.loss must be 'mse' or 'xent', not {self.loss!r}")


class MLP:
    """Stateless model: parameters are passed in as a flat array on every call.

    Keeping the parameters outside the model lets the same ``MLP`` serve every rank, the
    single-device oracle and the parameter server, each with its own flat vector.

    Args:
        cfg: the network's shape.
    """

    def __init__(self, cfg: MLPConfig):
        self.cfg = cfg
        dims = (cfg.in_dim, *cfg.hidden, cfg.out_dim)
        self.num_layers = len(dims) - 1
        self.param_names: list[str] = []
        self.param_shapes: list[tuple[int, ...]] = []
        self.param_slices: list[slice] = []
        offset = 0
        for layer, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for name, shape in ((f"W{layer}", (fan_in, fan_out)), (f"b{layer}", (fan_out,))):
                size = math.prod(shape)
                self.param_names.append(name)
                self.param_shapes.append(shape)
                self.param_slices.append(slice(offset, offset + size))
                offset += size
        self.num_params = offset

    def layer_params(self, layer: int) -> tuple[int, int]:
        """Indices into ``param_slices`` of ``layer``'s parameters, ``W`` then ``b``: the order
        ``backward`` fills their gradients in before it yields the layer.

        Args:
            layer: the layer, 0..num_layers - 1.

        Returns:
            (W's index, b's index).

        Raises:
            ConfigError: a layer out of range.
        """
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer must be in 0..{self.num_layers - 1}, got {layer}")
        return 2 * layer, 2 * layer + 1

    def layer_slice(self, layer: int) -> slice:
        """Flat range holding ``W{layer}`` and ``b{layer}`` (contiguous by construction).

        Args:
            layer: the layer.

        Returns:
            The slice of the flat parameter vector.

        Raises:
            ConfigError: a layer out of range.
        """
        w, b = self.layer_params(layer)
        return slice(self.param_slices[w].start, self.param_slices[b].stop)

    def init_params(self, seed: int, dtype: DTypeLike = np.float64) -> np.ndarray:
        """Deterministic flat parameters: Xavier-normal for tanh, He-normal for relu, zero biases.

        Drawn in float64 and then cast, so the float32 start is the float64 start rounded:
        runs in both precisions begin at the same point.

        Args:
            seed: the weights' seed.
            dtype: the parameters' dtype.

        Returns:
            A flat array of ``num_params``.
        """
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.num_params, dtype=np.float64)
        layout = zip(self.param_names, self.param_shapes, self.param_slices, strict=True)
        for name, shape, sl in layout:
            if name.startswith("W"):
                fan_in, fan_out = shape
                var = 2.0 / fan_in if self.cfg.activation == "relu" else 2.0 / (fan_in + fan_out)
                flat[sl] = rng.standard_normal(fan_in * fan_out) * math.sqrt(var)
        return flat.astype(dtype)

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each parameter as a view into ``flat`` (writes go through; nothing is copied).

        Args:
            flat: a flat array (or tensor) of ``num_params``.

        Returns:
            ``[W0, b0, W1, b1, ...]``.

        Raises:
            ConfigError: ``flat`` has the wrong shape.
        """
        if flat.ndim != 1 or flat.shape[0] != self.num_params:
            raise ConfigError(
                f"expected a flat array of shape ({self.num_params},), got {flat.shape}: "
                "use model.init_params() or np.zeros(model.num_params)"
            )
        layout = zip(self.param_slices, self.param_shapes, strict=True)
        return [flat[sl].reshape(shape) for sl, shape in layout]

    def forward(self, params: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        """Return ``acts``: ``acts[l]`` is the input of layer l, ``acts[-1]`` the output logits.

        The inputs of every layer are exactly what the backward needs (for tanh and relu
        the derivative can be read off the activation itself), so that is the cache.

        Args:
            params: the flat parameters.
            x: the inputs, (batch, in_dim).

        Returns:
            ``acts``, num_layers + 1 arrays.

        Raises:
            ConfigError: ``x`` has the wrong shape, or ``params`` does.
        """
        xp = array_namespace(params)
        x = xp.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.cfg.in_dim:
            raise ConfigError(f"x must have shape (batch, {self.cfg.in_dim}), got {x.shape}")
        p = self.views(params)
        acts = [xp.asarray(x, dtype=params.dtype)]
        for layer in range(self.num_layers):
            z = acts[-1] @ p[2 * layer] + p[2 * layer + 1]
            if layer < self.num_layers - 1:
                z = xp.tanh(z) if self.cfg.activation == "tanh" else z.clip(min=0)  # relu
            acts.append(z)
        return acts

    def loss(self, acts: list[np.ndarray], y: np.ndarray, scale: float) -> float:
        """``scale * sum_i loss_i`` over the rows of the batch.

        A SUM, not a mean: callers pass ``scale = 1 / global_batch``. A rank that holds a
        shard of the global batch then computes exactly its share of the global mean, and
        the ranks' losses and gradients simply add up to the full-batch ones, however
        unevenly the batch was split (even an empty shard contributes a correct zero).

        Args:
            acts: what ``forward`` returned.
            y: the targets.
            scale: what the summed loss is multiplied by.

        Returns:
            The scaled loss, a Python float.

        Raises:
            ConfigError: targets of the wrong shape or kind.
        """
        out = acts[-1]
        xp, y = array_namespace(out), self._targets(y, out)
        if self.cfg.loss == "mse":
            per_sample = 0.5 * xp.sum((out - y) ** 2, axis=1)
        else:  # row i's log-probability of its label y[i]
            per_sample = -_log_softmax(out)[range(len(y)), y]
        return float(scale * xp.sum(per_sample))

    def backward(
        self, params: np.ndarray, acts: list[np.ndarray], y: np.ndarray, grad: np.ndarray,
        scale: float,
    ) -> Iterator[int]:
        """Accumulate ``d loss / d params`` into ``grad``, yielding each layer as it completes.

        Layers come out last first (L-1, ..., 0), the order backprop produces them. Right
        after yielding l, the slices ``layer_slice(k)`` for k >= l hold their final values
        and nothing below l has been touched yet, so a data-parallel trainer may start
        all-reducing them while the earlier layers are still being computed. Nothing runs
        after layer 0 is yielded. Gradients are ADDED (``+=``) so micro-batches accumulate;
        zero ``grad`` at the start of a step. Stop iterating early and the gradient is
        incomplete: drain the generator (``loss_and_grad`` does).

        Args:
            params: the flat parameters.
            acts: what ``forward`` returned for them.
            y: the targets.
            grad: the flat gradient, added into.
            scale: the loss's scale.

        Yields:
            Each layer's index as its gradient is final, L - 1 first.

        Raises:
            ConfigError: targets of the wrong shape or kind, or arrays of the wrong shape.
        """
        xp, p, g = array_namespace(params), self.views(params), self.views(grad)
        out = acts[-1]
        y = self._targets(y, out)
        if self.cfg.loss == "mse":
            delta = out - y
        else:  # d(-log softmax[label]) / d logits = softmax - onehot
            delta = xp.exp(_log_softmax(out))
            delta[range(len(y)), y] -= 1
        delta *= scale  # d (scaled loss) / d output logits (scale is rounded to delta's dtype)
        for layer in reversed(range(self.num_layers)):
            g[2 * layer] += acts[layer].T @ delta
            g[2 * layer + 1] += delta.sum(axis=0)
            yield layer
            if layer > 0:  # push delta through W, then through the activation of acts[layer]
                a = acts[layer]
                dact = 1 - a * a if self.cfg.activation == "tanh" else a > 0  # True, False: 1, 0
                delta = (delta @ p[2 * layer].T) * dact

    def loss_and_grad(
        self, params: np.ndarray, x: np.ndarray, y: np.ndarray, scale: float,
        grad: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray]:
        """Forward, loss and the whole backward. Accumulates into ``grad`` if given.

        Args:
            params: the flat parameters.
            x: the inputs.
            y: the targets.
            scale: the loss's scale.
            grad: the flat gradient to add into, or None for a new zeroed one.

        Returns:
            (loss, grad).

        Raises:
            ConfigError: shapes or dtypes that do not match.
        """
        if grad is None:
            grad = array_namespace(params).zeros_like(params)
        if grad.dtype != params.dtype:
            raise ConfigError(f"grad dtype {grad.dtype} != params dtype {params.dtype}: match them")
        acts = self.forward(params, x)
        loss = self.loss(acts, y, scale)
        for _ in self.backward(params, acts, y, grad, scale):
            pass
        return loss, grad

    def _targets(self, y: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Check ``y`` against the loss; float targets take the dtype of the logits."""
        xp = array_namespace(out)
        y = xp.asarray(y)
        if self.cfg.loss == "mse":
            if y.shape != out.shape:
                raise ConfigError(f"mse targets must have shape {tuple(out.shape)}, got "
                                  f"{tuple(y.shape)}")
            return xp.asarray(y, dtype=out.dtype)
        # int64, torch.int64
        integers = str(y.dtype).removeprefix("torch.").startswith(("int", "uint"))
        if y.shape != out.shape[:1] or (len(y) and not integers):
            raise ConfigError("xent targets must be integer labels of shape "
                              f"{tuple(out.shape[:1])}, got {y.dtype} {tuple(y.shape)}")
        if len(y) and (y.min() < 0 or y.max() >= self.cfg.out_dim):
            raise ConfigError(f"labels must be in 0..{self.cfg.out_dim - 1}")
        return xp.asarray(y, dtype=xp.int64)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    """Stable log-softmax over rows: subtracting the row max keeps exp() from overflowing."""
    xp = array_namespace(z)
    z = z - xp.amax(z, axis=1, keepdims=True)
    return z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
