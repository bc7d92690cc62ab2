"""Exercise (lesson 11): the dynamic loss scaler's rule, as torch's GradScaler keeps it.

float16 training multiplies the loss by a scale S so that small gradients do not underflow; too
large an S makes the scaled gradient overflow to inf. After each step's backward, every rank
checks the gradient for inf or nan (found_inf, the same on every rank) and the scaler decides:

    an overflow        skip the step (its gradient is garbage) and back off: S * backoff_factor;
                       start counting clean steps afresh
    no overflow        take the step; after growth_interval clean steps in a row, try a larger
                       scale: S * growth_factor, and start counting again

Write ``update(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval)``,
returning ``(new_scale, new_good_steps, take_step)``. good_steps is the count you returned last
time (0 at the start). GradScaler's defaults: S = 2**16, growth_factor 2, backoff_factor 0.5,
growth_interval 2000.

The body below never changes the scale and takes every step. Check yours (runs with overflows
given, and runs whose overflows come from the scale itself, against the engine's LossScaler):

    dplab lesson check 11 DIR
"""

from __future__ import annotations


def update(
    scale: float,
    good_steps: int,
    found_inf: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[float, int, bool]:
    return scale, good_steps, True
