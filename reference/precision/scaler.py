"""Loss scaling: keep small float16 gradients from flushing to zero, and survive overflows.

    scaler = LossScaler(MixedPrecision(), comm.tracer)
    model.backward(weights16, acts, y, grad, scale / B * scaler.loss_scale)  # the scaled loss's
    allreduce(comm, grad)                                                    # gradient
    found_inf = scaler.unscale_and_check(comm, grad, out=master_grad, replicated=True)
    if scaler.update(found_inf, step):                             # False: skip this step
        opt.step(master, master_grad)

Dynamic scaling follows torch.amp.GradScaler rule for rule (on an overflow skip the step and
multiply S by ``backoff_factor``; after ``growth_interval`` clean steps multiply by
``growth_factor``), except that a scale below float32's smallest normal (``SCALE_RANGE``) raises
``ConfigError``. A static S never changes; an overflow at it raises ``ConfigError`` before the
step, weights intact. Every skip, backoff, growth and static overflow is a ``"loss_scale"`` trace
event and a row of ``scaler.history``. Why scaling works: reference/README.md, "Beyond replicas".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dplab.reference.collectives import allreduce
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError
from dplab.reference.precision.config import SCALE_RANGE, MixedPrecision
from dplab.reference.trace import Tracer

__all__ = ["LossScaler", "ScaleEvent", "compute_copy"]


class ScaleEvent(NamedTuple):
    """One change of the loss scale, or a skipped step.

    Args:
        step: the step.
        action: "skip", "backoff", "growth" or "overflow".
        scale: the scale before.
        new_scale: the scale after.
    """
    step: int
    action: str  # skip | backoff | growth | overflow (static: the run stops before the step)
    scale: float  # before
    new_scale: float  # after


def compute_copy(master: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round the master weights into ``out`` (the float16 compute copy); returns ``out``.

    Round to nearest, as ``tensor.half()`` does; a master weight beyond 65504 becomes inf, which
    the next gradient check catches (its gradient is inf or nan).

    Args:
        master: the float32 masters.
        out: the float16 copy, the same shape.

    Returns:
        ``out``.

    Raises:
        ConfigError: ``out`` of another shape.
    """
    if out.shape != master.shape:
        raise ConfigError(f"compute copy has shape {out.shape}, master {master.shape}: allocate it "
                          "alike")
    with np.errstate(over="ignore"):
        np.copyto(out, master, casting="same_kind")
    return out


class LossScaler:
    """One rank's loss scale. Every rank must call it with the same found_inf (``unscale_and_check``
    makes sure), so the scales, and the skipped steps, agree everywhere.

    Args:
        cfg: the scaling rules.
        tracer: where "loss_scale" events go, or None.

    Raises:
        ConfigError: an invalid ``cfg``.
    """

    def __init__(self, cfg: MixedPrecision, tracer: Tracer | None = None) -> None:
        cfg.validate()
        self.cfg, self.tracer = cfg, tracer
        self._scale = float(cfg.init_scale if cfg.dynamic else cfg.loss_scale)
        self.growth_tracker = 0  # good steps in a row since the last backoff or growth
        self.history: list[ScaleEvent] = []
        self._flag: np.ndarray | None = None

    @property
    def loss_scale(self) -> float:
        """S: the factor the loss (the backward's ``scale``) is multiplied by this step."""
        return self._scale

    def unscale_and_check(
        self,
        comm: Communicator,
        grads: np.ndarray,
        out: np.ndarray | None = None,
        replicated: bool = False,
        algorithm: str = "ring",
    ) -> bool:
        """``out = grads / S`` (in float32 arithmetic, rounded to ``out``'s dtype; in place when
        ``out`` is None); True when any rank's result holds an inf or nan.

        ``replicated=True``: ``grads`` is bitwise the same on every rank (an all-reduce by one of
        our schedules: every chunk ends as a copy of one sum), and an inf or nan survives a sum, so
        each rank's own check is everyone's. Otherwise (a shard after a reduce-scatter, or an
        engine's all-reduce that may add in another order on each rank) the flag is all-reduced:
        one float, so every rank skips or steps together.

        Args:
            comm: this rank's communicator.
            grads: the reduced, scaled gradient.
            out: where the unscaled gradient goes, or None for in place.
            replicated: whether ``grads`` is bitwise the same on every rank.
            algorithm: the all-reduce for the flag.

        Returns:
            True if any rank found an inf or nan.

        Raises:
            ConfigError: ``out`` of another shape.
        """
        target = grads if out is None else out
        if target.shape != grads.shape:
            raise ConfigError(f"out has shape {target.shape}, grads {grads.shape}: use the same "
                              "shape")
        with np.errstate(over="ignore", invalid="ignore"):
            np.divide(grads, np.float32(self._scale), out=target, casting="same_kind")
        found = not bool(np.isfinite(target).all())
        if replicated:
            return found
        if self._flag is None:
            self._flag = comm.empty(1, "float32")
        self._flag[0] = 1.0 if found else 0.0
        if algorithm == "auto":  # the cost model loads for runs that ask for it
            from dplab.reference.auto import chosen

            algorithm = chosen(comm, self._flag)
        allreduce(comm, self._flag, algorithm)
        return bool(self._flag[0] > 0)

    def update(self, found_inf: bool, step: int = -1) -> bool:
        """Apply the scaling rule after a step's check; True when the optimizer should step now.

        Raises ``ConfigError`` on an overflow at a static scale, and where a backoff would take the
        dynamic scale below ``SCALE_RANGE`` (module docstring). Every rank gets the same
        ``found_inf``, so every rank raises at the same step.

        Args:
            found_inf: what ``unscale_and_check`` returned.
            step: the step, for the trace and the error.

        Returns:
            True when the optimizer should step.
        """
        s, cfg = self._scale, self.cfg
        if not cfg.dynamic:
            if found_inf:
                self._event(step, "overflow", s, s)
                raise ConfigError(f"step {step}: the gradients overflowed float16 (inf or nan) at "
                                  f"the static loss scale {s:g}: use a smaller one, or 'dynamic' "
                                  "to skip such steps (dplab train: --loss-scale)")
            return True
        if found_inf:
            self._event(step, "skip", s, s)
            if s * cfg.backoff_factor < SCALE_RANGE[0]:
                raise ConfigError(f"step {step}: the gradients held inf or nan at every loss scale "
                                  f"down to {s:.3g}, so the loss or the weights themselves are not "
                                  "finite: the run diverged; lower the learning rate")
            self._set(step, "backoff", s * cfg.backoff_factor)
            self.growth_tracker = 0
            return False
        self.growth_tracker += 1
        if self.growth_tracker == cfg.growth_interval:
            if np.isfinite(np.float32(s * cfg.growth_factor)):  # torch keeps S in a float32
                self._set(step, "growth", s * cfg.growth_factor)
            self.growth_tracker = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep for a resumed run to scale as an uninterrupted one.

        Returns:
            The scale and the growth tracker.
        """
        return {"scale": self._scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned.

        Args:
            state: the saved scale and growth tracker.

        Raises:
            ConfigError: a scale outside float32's normal range (a damaged checkpoint).
        """
        scale = float(state["scale"])
        if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:  # nan fails too
            raise ConfigError(f"the saved loss scale {scale!r} is outside float32's normal range: "
                              "the checkpoint is damaged; resume from an earlier one")
        self._scale, self.growth_tracker = scale, int(state["growth_tracker"])

    def _set(self, step: int, action: str, new_scale: float) -> None:
        self._event(step, action, self._scale, new_scale)
        self._scale = new_scale

    def _event(self, step: int, action: str, scale: float, new_scale: float) -> None:
        self.history.append(ScaleEvent(step, action, scale, new_scale))
        if self.tracer is not None:
            t = self.tracer.now()
            self.tracer.record(
                "loss_scale",
                t,
                t,
                extra={"step": step, "action": action, "scale": scale, "new_scale": new_scale},
            )
