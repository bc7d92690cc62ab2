"""Hooks: what a real run adds to the synchronous recipe, each at the point its method names.

    train_sync(comm, cfg, SyncConfig(checkpoint=ckpt))    # the hooks a SyncConfig asks for
    train_sync(comm, cfg, sync, hooks=[MyHook()])         # and your own, after them

A hook overrides the points it needs; ``Hook``'s own methods change nothing. The recipe calls
every point on every step through ``Hooks``, all the attached hooks as one: with none attached
(``Hooks([])``) each call does nothing, and what runs is the recipe's five steps alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Run", "Hook", "Hooks"]


@dataclass
class Run:
    """One rank's run as the hooks see it; ``on_start`` may change any field before the first
    step.

    Args:
        params: the replicas' parameters, stepped in place.
        opt: the optimizer that steps them.
        grad_dtype: the gradient buffer's dtype.
        start: the first step to take.
        losses: the global loss of each step so far.
    """

    # the replicas' parameters, stepped in place (mixed precision: the masters; on a GPU, a torch
    # tensor there: ``Communicator.compute_device``)
    params: np.ndarray
    opt: Any  # what steps them: ``opt.step(params, grad)``, ``state_dict()``, ``load_state_dict()``
    grad_dtype: np.dtype  # the gradient buffer's dtype: what the buckets all-reduce
    start: int = 0  # the first step to take (a resumed run: where its checkpoint ends)
    losses: list[float] = field(default_factory=list)  # the global batch's loss, per step so far


class Hook:
    """One thing a run adds to the recipe. Each method runs where its name says;
    these do nothing."""

    def on_start(self, run: Run) -> None:
        """After the broadcast, before the first step (resume; swap the optimizer or gradient
        dtype).

        Args:
            run: this rank's run: change its fields in place.
        """

    def compute(self, step: int, params: np.ndarray, scale: float) -> tuple[np.ndarray, float]:
        """The weights forward and backward use in ``step``, and the scale of the backward's
        loss.

        Args:
            step: the step about to run.
            params: the parameters (mixed precision: the float32 masters).
            scale: the loss's scale, 1 / global_batch.

        Returns:
            (weights, scale) for this step: here ``params`` and ``scale`` unchanged.
        """
        return params, scale

    def forward(self, step: int, micro: int) -> AbstractContextManager[Any]:
        """Around micro-batch ``micro``'s forward pass and loss.

        Args:
            step: the step.
            micro: the micro-batch within it.

        Returns:
            A context manager: here one that does nothing.
        """
        return nullcontext()

    def backward(self, step: int, micro: int, layers: Iterator[int]) -> Iterator[int]:
        """The backward pass's layers, handed on to the reducer (one may time or pace them).

        Args:
            step: the step.
            micro: the micro-batch within it.
            layers: the layer indices backward yields, last layer first.

        Returns:
            The layers, handed on: here ``layers`` itself.
        """
        return layers

    def phase(self, name: str, step: int) -> AbstractContextManager[Any]:
        """Around the step's ``"wait"`` for the last bucket, and its ``"optimizer"`` step.

        Args:
            name: "wait" or "optimizer".
            step: the step.

        Returns:
            A context manager: here one that does nothing.
        """
        return nullcontext()

    def wants_to_stop(self, step: int) -> bool:
        """True asks every rank to stop after ``step`` (a time budget ran out). One rank asking is
        enough: the recipe sums the requests with the loss (``sync.loss_and_stop``), so all
        agree.

        Args:
            step: the step just taken.

        Returns:
            Whether to stop after it: here False.
        """
        return False

    def after_step(self, run: Run, step: int) -> None:
        """After ``step``'s update, with its global loss in ``run.losses``.

        Args:
            run: this rank's run.
            step: the step just taken.
        """


class Hooks(Hook):
    """Several hooks as one: each point runs them in order, the first one's context outermost.

    Empty (``Hooks([])``), every point does nothing and hands back what it was given; it is then
    false, for a caller that wants to know.

    Args:
        hooks: the hooks, outermost first.
    """

    def __init__(self, hooks: Iterable[Hook]) -> None:
        self.hooks = list(hooks)

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def on_start(self, run: Run) -> None:
        for hook in self.hooks:
            hook.on_start(run)

    def compute(self, step: int, params: np.ndarray, scale: float) -> tuple[np.ndarray, float]:
        for hook in self.hooks:
            params, scale = hook.compute(step, params, scale)
        return params, scale

    @contextmanager
    def forward(self, step: int, micro: int) -> Iterator[None]:
        with ExitStack() as inside:
            for hook in self.hooks:
                inside.enter_context(hook.forward(step, micro))
            yield

    def backward(self, step: int, micro: int, layers: Iterator[int]) -> Iterator[int]:
        for hook in reversed(self.hooks):
            # the first hook sees the layers last: it wraps the others
            layers = hook.backward(step, micro, layers)
        return layers

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        with ExitStack() as inside:
            for hook in self.hooks:
                inside.enter_context(hook.phase(name, step))
            yield

    def wants_to_stop(self, step: int) -> bool:
        return any([hook.wants_to_stop(step) for hook in self.hooks])  # every hook is asked

    def after_step(self, run: Run, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(run, step)
