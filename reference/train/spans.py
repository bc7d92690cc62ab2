"""Trace spans of a synchronous step, as a hook: forward, backward, wait and optimizer.

Attached by ``SyncConfig.hooks`` while the rank's tracer is on; the timeline draws them
around the buckets the reducer records itself (``dplab.reference.trace``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from dplab.reference.trace import Tracer
from dplab.reference.train.hooks import Hook

__all__ = ["Spans"]


class Spans(Hook):
    """One span per phase, each with its ``step`` (and ``micro``-batch) in ``extra``.

    Args:
        tracer: where the spans go.
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def forward(self, step: int, micro: int) -> AbstractContextManager[Any]:
        return self.tracer.span("forward", extra={"step": step, "micro": micro})

    def backward(self, step: int, micro: int, layers: Iterator[int]) -> Iterator[int]:
        with self.tracer.span("backward", extra={"step": step, "micro": micro}):
            yield from layers

    def phase(self, name: str, step: int) -> AbstractContextManager[Any]:
        return self.tracer.span(name, extra={"step": step})
