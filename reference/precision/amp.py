"""Mixed precision inside ``train_sync``: the calls its recipe makes, and nothing more.

    amp = Amp(comm, sync, params)                    # params: the float32 masters
    grad = comm.empty(n, amp.reduce_dtype)           # the buffer the buckets all-reduce
    weights = amp.weights(params)                    # per step: the float16 compute copy
    model.backward(weights, acts, y, grad, amp.scale(1 / B))          # the loss times S
    amp.step(opt, params, grad, step)                # grad / S in float32, or skip on an overflow

What happens in one step, torch AMP's order: the masters are rounded to a float16 copy; forward
and backward run on it with the loss multiplied by S; the gradient lands in (and is all-reduced
in) ``reduce_dtype``; it is divided by S into a float32 buffer and checked for inf/nan; the
scaler decides (``dplab.reference.precision.scaler``); the optimizer steps the float32 masters.
Without ``SyncConfig.precision`` every call passes its argument through (S = 1 exactly), so the
plain run is unchanged, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dplab.reference.communicator import Communicator
from dplab.reference.optim import Optimizer
from dplab.reference.precision.scaler import LossScaler, compute_copy

__all__ = ["Amp"]


class Amp:
    """One rank's mixed precision for the synchronous trainer (``sync``: a ``SyncConfig``)."""

    def __init__(self, comm: Communicator, sync: Any, master: np.ndarray) -> None:
        self.comm, self.precision = comm, sync.precision
        self.scaler: LossScaler | None = None
        self.skipped = 0  # steps skipped on an overflow: the optimizer's step count lags by this
        self.reduce_dtype = master.dtype
        if self.precision is None:
            return
        self.precision.validate(master.dtype)
        self.reduce_dtype = np.dtype(self.precision.reduce_dtype)
        self.scaler = LossScaler(self.precision, comm.tracer)
        self._weights = np.empty(master.shape, self.precision.compute_dtype)
        self._master_grad = np.empty_like(master)
        # our schedules leave the same bits on every rank; an engine's all-reduce may not (see scaler),
        # and "auto" may pick the engine's (reference/auto.py)
        self._replicated, self._algorithm = sync.algorithm not in ("native", "auto"), sync.algorithm

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.loss_scale

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run scales as an uninterrupted one ({} when off)."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.state_dict(), "skipped_steps": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned (a dict with a ``"loss_scale"`` entry, or without)."""
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
            self.skipped = int(state["skipped_steps"])

    def weights(self, master: np.ndarray) -> np.ndarray:
        """The weights forward and backward use this step: the masters rounded to float16."""
        return master if self.scaler is None else compute_copy(master, self._weights)

    def scale(self, scale: float) -> float:
        """The backward's ``scale`` times S: the gradient of the scaled loss (torch: scaler.scale(loss))."""
        return scale if self.scaler is None else scale * self.scaler.loss_scale

    def step(self, opt: Optimizer, master: np.ndarray, grad: np.ndarray, step: int) -> bool:
        """``opt.step`` on the masters, as torch's ``scaler.step(opt)``: with the reduced gradient
        divided by S into float32, unless it holds an inf or nan and the scale is dynamic (then
        nothing moves, optimizer state included; every rank decides alike). True if it stepped."""
        if self.scaler is None:
            opt.step(master, grad)
            return True
        found_inf = self.scaler.unscale_and_check(self.comm, grad, self._master_grad,
                                                  self._replicated, self._algorithm)
        if not self.scaler.update(found_inf, step):
            self.skipped += 1
            return False
        opt.step(master, self._master_grad)
        return True
