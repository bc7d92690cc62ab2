"""Solution (lesson 11): the dynamic loss scaler's rule.

The engine's, which also checks the scale's range and records each change:
dplab/reference/precision/scaler.py (LossScaler.update).
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
    if found_inf:  # skip the step, back off, count afresh
        return scale * backoff_factor, 0, False
    good = good_steps + 1
    if good == growth_interval:  # growth_interval clean steps in a row: try a larger scale
        return scale * growth_factor, 0, True
    return scale, good, True
