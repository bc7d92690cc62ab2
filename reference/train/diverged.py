"""A run that diverged: one line that says so, instead of a table of nan.

``train_sync`` checks a finished run; a checkpoint checks its parameters before it keeps them. A
non-finite loss on a step that dynamic loss scaling skipped is not divergence (the weights did
not move, as torch's GradScaler carries on), so only the last step's loss counts.
"""

from __future__ import annotations

import math

import numpy as np

from dplab.reference.errors import ConfigError

__all__ = ["check_finite"]


def check_finite(params: np.ndarray, losses: list[float], ended: bool = True) -> None:
    """ConfigError if ``params`` hold inf or nan, or if the run ``ended`` on a loss that is not finite."""
    step = len(losses) - 1
    if not np.isfinite(params).all():
        first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)  # where it showed
        when = f"the loss was {losses[step]:.3g}" if first is None else f"the loss turned {losses[first]} " \
            f"at step {first}"
        raise ConfigError(f"step {step}: the parameters are inf or nan after the update ({when}): the run "
                          "diverged; lower the learning rate")
    if ended and losses and not math.isfinite(losses[-1]):
        raise ConfigError(f"step {step}: the loss of the last step is {losses[-1]}: the run "
                          "diverged; lower the learning rate")
