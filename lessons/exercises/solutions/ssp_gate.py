"""Solution (lesson 7): the SSP gate.

A worker may start clock c once the slowest has finished c - s clocks: then it is at most s
clocks ahead. The engine's: ``gate_open`` in dplab/reference/ps/gate.py.
"""

from __future__ import annotations


def may_proceed(clock: int, slowest: int, staleness: int | None) -> bool:
    return staleness is None or slowest >= clock - staleness
