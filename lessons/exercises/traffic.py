"""What a learner's collectives send, counted where the learner's code cannot reset it.

    traffic = Traffic.install(comm)       # in a rank: comm.tracer counts from now on, no events
    traffic.start()                       # zero the counts, count
    zero2_step(comm, ...)                 # the learner's code
    traffic.stop()
    traffic.sent, traffic.called          # bytes sent, collectives called, in between
    traffic.tampered(comm)                # why the counts cannot be trusted, or ""

The executor reports every message to ``comm.tracer``; the counts live here, in an object the
learner's code is never handed. The tracer it sees only adds to them, and refuses to have anything
set on it (``comm.tracer.sent = 0``, ``.enabled = False``, ``.record = ...`` raise, naming the
learner's line); replacing ``comm.tracer`` or stopping ``tracemalloc`` (the memory the exercises
measure) is named by ``tampered``. Honest verdicts, not a sandbox: code that goes looking for the
counts finds them.
"""

from __future__ import annotations

import tracemalloc
from collections import Counter
from typing import Any

from dplab.reference.trace import Tracer

__all__ = ["Traffic", "KINDS"]

KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast")  # the collectives' span names


class Traffic:
    """Bytes sent and collectives called by one rank while counting (``start`` .. ``stop``)."""

    def __init__(self, rank: int) -> None:
        self.on = False
        self.sent = 0
        self.called: Counter[str] = Counter()
        self.tracer = _counting_tracer(self, rank)
        # the caller's clock (e.g. layers backward has yielded), read per call
        self.when: Any = None
        self.marks: list[tuple[str, Any]] = []  # (collective, ``when()`` at its call), in order

    @classmethod
    def install(cls, comm: Any) -> Traffic:
        """Count what ``comm`` sends: its tracer becomes this counter's."""
        traffic = cls(comm.rank)
        comm.tracer = traffic.tracer
        return traffic

    def start(self) -> None:
        # every key made now: a dict growing during the learner's call would count as its memory
        self.sent, self.called, self.on = 0, Counter(dict.fromkeys(KINDS, 0)), True
        self.marks = []

    def stop(self) -> None:
        self.on = False

    def add(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "send":
            self.sent += int(fields.get("bytes", 0))
        elif kind in KINDS:
            self.called[kind] += 1
            if self.when is not None:
                self.marks.append((kind, self.when()))

    def tampered(self, comm: Any, what: str) -> str:
        """Why this rank's counts (or its measured memory) cannot be trusted after ``what`` ran,
        or ""."""
        if comm.tracer is not self.tracer:
            return (f"{what} replaced comm.tracer, through which the check counts the bytes your "
                    "collectives send: leave comm.tracer as it is")
        if not tracemalloc.is_tracing():
            return (f"{what} stopped tracemalloc, with which the check measures the memory a step "
                    "holds: leave tracemalloc alone")
        return ""


def _counting_tracer(traffic: Traffic, rank: int) -> Tracer:
    """A tracer that adds to ``traffic`` and keeps no events (the memory measured is the step's)."""

    class CountingTracer(Tracer):
        enabled = property(lambda self: traffic.on)

        def __init__(self) -> None:  # no Tracer.__init__: it would set ``enabled``
            for name, value in (("rank", rank), ("offset_ns", 0), ("events", [])):
                object.__setattr__(self, name, value)

        def __setattr__(self, name: str, value: Any) -> None:
            if name not in ("offset_ns", "events"):  # what Tracer's own methods set
                raise AttributeError(f"comm.tracer is the check's, counting the bytes your "
                                     f"collectives send: its {name} cannot be set")
            object.__setattr__(self, name, value)

        def record(self, kind: str, t_start_ns: int, t_end_ns: int, **fields: Any) -> None:
            if traffic.on:
                traffic.add(kind, fields)

    return CountingTracer()
