"""Mixed precision as a hook of ``train_sync``: float16 compute, float32 masters, a scaled loss.

    train_sync(comm, cfg, SyncConfig(precision=MixedPrecision()))   # attaches Amp(comm, sync)

One step, torch AMP's order: the masters are rounded to a float16 copy (``compute``); forward and
backward run on it with the loss multiplied by S; the gradient lands in (and is all-reduced in)
``reduce_dtype`` (``on_start`` sets it); the optimizer, wrapped as torch's ``scaler.step(opt)``,
divides it by S into float32, checks it for inf/nan, lets the scaler decide
(``dplab.reference.precision.scaler``) and steps the float32 masters, or skips the step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.optim import Optimizer
from dplab.reference.precision.scaler import LossScaler, compute_copy
from dplab.reference.train.hooks import Hook, Run

__all__ = ["Amp"]


class Amp(Hook):
    """One rank's mixed precision (``sync``: a ``SyncConfig`` with ``precision``).

    ``master``: the float32 masters, to size the buffers now; without it ``on_start`` does.

    Args:
        comm: this rank's communicator.
        sync: the run's ``SyncConfig`` (its ``precision`` and ``algorithm``).
        master: the float32 masters, or None to size the buffers in ``on_start``.

    Raises:
        ConfigError: ``sync.precision`` is None.
    """

    def __init__(self, comm: Communicator, sync: Any, master: np.ndarray | None = None) -> None:
        if sync.precision is None:
            raise ConfigError("Amp needs SyncConfig.precision: set it, or attach no Amp")
        self.comm, self.precision = comm, sync.precision
        self.reduce_dtype = np.dtype(self.precision.reduce_dtype)
        self.scaler = LossScaler(self.precision, comm.tracer)
        self.skipped = 0  # steps skipped on an overflow: the optimizer's step count lags by this
        self.step_now = 0  # the step ``compute`` last prepared: the one the optimizer takes next
        # our schedules leave the same bits on every rank; an engine's all-reduce may not (see
        # scaler), and "auto" may pick the engine's (reference/auto.py)
        self._replicated, self._algorithm = sync.algorithm not in ("native", "auto"), sync.algorithm
        if master is not None:
            self._buffers(master)

    def _buffers(self, master: np.ndarray) -> None:
        self.precision.validate(master.dtype)
        self._weights = np.empty(master.shape, self.precision.compute_dtype)
        self._master_grad = np.empty_like(master)

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    def on_start(self, run: Run) -> None:
        """Gradients in ``reduce_dtype``; the optimizer unscales, checks and steps (or skips).

        Args:
            run: this rank's run: its gradient dtype and optimizer are swapped here.
        """
        self._buffers(run.params)
        run.grad_dtype = self.reduce_dtype
        run.opt = ScaledStep(self, run.opt)

    def compute(self, step: int, params: np.ndarray, scale: float) -> tuple[np.ndarray, float]:
        """The masters rounded to float16, and the loss's scale times S (torch:
        scaler.scale(loss)).

        Args:
            step: the step about to run.
            params: the float32 masters.
            scale: the loss's scale.

        Returns:
            (float16 weights, scale times S).
        """
        self.step_now = step
        return compute_copy(params, self._weights), scale * self.scaler.loss_scale

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run scales as an uninterrupted one.

        Returns:
            The scaler's state and the number of skipped steps.
        """
        return {"loss_scale": self.scaler.state_dict(), "skipped_steps": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned (a dict with a ``"loss_scale"`` entry, or
        without).

        Args:
            state: what ``state_dict()`` returned.

        Raises:
            ConfigError: a damaged loss scale.
        """
        if "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
            self.skipped = int(state["skipped_steps"])

    def step(self, opt: Optimizer, master: np.ndarray, grad: np.ndarray, step: int) -> bool:
        """``opt.step`` on the masters, as torch's ``scaler.step(opt)``: with the reduced gradient
        divided by S into float32, unless it holds an inf or nan and the scale is dynamic (then
        nothing moves, optimizer state included; every rank decides alike). True if it stepped.

        Args:
            opt: the optimizer.
            master: the float32 master weights.
            grad: the reduced, scaled gradient.
            step: the step, for the trace.

        Returns:
            True if the optimizer stepped; False if the step was skipped.

        Raises:
            ConfigError: an overflow at a static scale, or a dynamic scale that fell out of range.
        """
        found_inf = self.scaler.unscale_and_check(self.comm, grad, self._master_grad,
                                                  self._replicated, self._algorithm)
        if not self.scaler.update(found_inf, step):
            self.skipped += 1
            return False
        opt.step(master, self._master_grad)
        return True


class ScaledStep:
    """An optimizer that takes the scaled gradient: ``step`` is ``amp.step``;
    its state is ``opt``'s."""

    def __init__(self, amp: Amp, opt: Optimizer) -> None:
        self.amp, self.opt = amp, opt

    def step(self, master: np.ndarray, grad: np.ndarray) -> None:
        self.amp.step(self.opt, master, grad, self.amp.step_now)

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)
