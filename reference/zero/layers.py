"""The MLP one layer at a time: what a trainer needs when it holds only one layer's weights.

``MLP.forward``/``MLP.backward`` take the whole flat parameter vector. ZeRO stage 3 never has
it: it all-gathers layer l's weights, uses them, and frees them. So these functions take one
layer's flat slice ``w = [W_l, b_l]`` and do, operation for operation, what
``dplab.reference.model`` does for that layer (the tests check the gradients are bitwise the same):

    acts = [x]
    for l in range(L):            acts.append(layer_forward(model, l, w_l, acts[-1]))
    delta = output_delta(model, acts[-1], y, scale)
    for l in reversed(range(L)):  layer_grads(model, l, acts[l], delta, g_l)       # += into g_l
                                  if l: delta = layer_delta(model, l, w_l, acts[l], delta)
"""

from __future__ import annotations

import numpy as np

from dplab.reference.model import MLP

__all__ = ["layer_weights", "layer_forward", "output_delta", "layer_grads", "layer_delta"]


def layer_weights(model: MLP, layer: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Views ``(W, b)`` of one layer's flat slice ``w`` (writes go through).

    Args:
        model: the MLP.
        layer: the layer.
        w: the layer's flat slice ``[W, b]``.

    Returns:
        (W, b), views of ``w``.
    """
    fan_in, fan_out = model.param_shapes[model.layer_params(layer)[0]]
    return w[: fan_in * fan_out].reshape(fan_in, fan_out), w[fan_in * fan_out:]


def layer_forward(model: MLP, layer: int, w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Layer ``layer``'s output from its input ``a``: ``act(a @ W + b)``, no activation on the
    last.

    Args:
        model: the MLP.
        layer: the layer.
        w: the layer's flat slice ``[W, b]``.
        a: its input, (batch, fan_in).

    Returns:
        Its output, (batch, fan_out).
    """
    W, b = layer_weights(model, layer, w)
    z = a @ W + b  # ``a`` in w's dtype: the trainer casts the batch once, as MLP.forward does
    if layer < model.num_layers - 1:
        z = np.tanh(z) if model.cfg.activation == "tanh" else np.maximum(z, 0)
    return z


def output_delta(model: MLP, out: np.ndarray, y: np.ndarray, scale: float) -> np.ndarray:
    """d (scale * summed loss) / d logits, as ``MLP.backward`` starts it.

    Args:
        model: the MLP (its loss: mse or xent).
        out: the last layer's output.
        y: the targets.
        scale: the loss's scale.

    Returns:
        The gradient with respect to the output.
    """
    if model.cfg.loss == "mse":
        delta = out - np.asarray(y).astype(out.dtype, copy=False)
    else:  # softmax - onehot, with the stable log-softmax of model.py
        z = out - out.max(axis=1, keepdims=True)
        delta = np.exp(z - np.log(np.sum(np.exp(z), axis=1, keepdims=True)))
        delta[np.arange(len(y)), np.asarray(y).astype(np.intp, copy=False)] -= 1
    delta *= out.dtype.type(scale)
    return delta


def layer_grads(model: MLP, layer: int, a: np.ndarray, delta: np.ndarray, g: np.ndarray) -> None:
    """ADD layer ``layer``'s gradient into its flat slice ``g`` (micro-batches accumulate).

    Args:
        model: the MLP.
        layer: the layer.
        a: the layer's input.
        delta: the gradient with respect to its output.
        g: the layer's flat gradient slice, added into.
    """
    gW, gb = layer_weights(model, layer, g)
    gW += a.T @ delta
    gb += delta.sum(axis=0)


def layer_delta(
    model: MLP, layer: int, w: np.ndarray, a: np.ndarray, delta: np.ndarray
) -> np.ndarray:
    """Push ``delta`` back through layer ``layer``'s W and the activation of its input ``a``.

    Args:
        model: the MLP.
        layer: the layer.
        w: the layer's flat slice ``[W, b]``.
        a: its input (the previous layer's activation).
        delta: the gradient with respect to its output.

    Returns:
        The gradient with respect to the previous layer's output.
    """
    W, _ = layer_weights(model, layer, w)
    dact = 1 - a * a if model.cfg.activation == "tanh" else (a > 0).astype(a.dtype)
    return (delta @ W.T) * dact
