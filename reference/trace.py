"""Trace events of real runs, merged across ranks and exported to Chrome-trace (Perfetto).

Every send, receive-and-reduce, copy, compute phase and wait is one ``Event``. A
``Tracer`` lives on every Communicator; it costs one attribute check when off.
Clocks: ranks on one machine share CLOCK_MONOTONIC (``time.perf_counter_ns``), so
their events line up as they are; ranks on several machines call ``align_clock``
once at start-up, which estimates each rank's offset from rank 0 by ping-pong.

    dplab train --trace run.json          # then open run.chrome.json in ui.perfetto.dev
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Event", "Tracer", "align_clock", "merge", "save_json", "load_json", "to_chrome"]

_OFF = nullcontext()  # every disabled tracer's span


@dataclass(frozen=True)
class Event:
    """One traced thing a rank did: a span from ``t_start_ns`` to ``t_end_ns`` on its clock.

    Args:
        rank: the rank.
        kind: what it was ("send", "reduce", "bucket", "forward", "wait", ...).
        t_start_ns: its start, nanoseconds on the aligned clock.
        t_end_ns: its end.
        peer: the other rank of a transfer (-1: none).
        bytes: bytes moved.
        chunk: the schedule's chunk (-1: none).
        round: the schedule's round (-1: none).
        algorithm: the collective's algorithm.
        thread: "main", or "comm" for the reduction thread.
        extra: kind-specific fields (bucket, step, staleness, ...).
    """
    rank: int
    kind: str  # send | reduce | copy | allreduce | forward | backward | optimizer | wait | ...
    t_start_ns: int
    t_end_ns: int
    peer: int = -1
    bytes: int = 0
    chunk: int = -1
    round: int = -1
    algorithm: str = ""
    thread: str = "main"  # "comm" for the gradient-reduction thread
    # kind-specific: bucket, step, staleness
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


class Tracer:
    """One rank's event recorder; when off, recording costs one attribute test.

    Args:
        rank: the rank its events carry.
        enabled: record events.
        offset_ns: added to every time, to read like rank 0's clock (``align_clock``).
    """
    def __init__(self, rank: int, enabled: bool = False, offset_ns: int = 0) -> None:
        self.rank, self.enabled, self.offset_ns = rank, enabled, offset_ns
        self.events: list[Event] = []

    def now(self) -> int:
        """Nanoseconds on this rank's clock, aligned to rank 0's (``align_clock``).

        Returns:
            ``time.perf_counter_ns()`` plus the offset.
        """
        return time.perf_counter_ns() + self.offset_ns

    def record(self, kind: str, t_start_ns: int, t_end_ns: int, **fields: Any) -> None:
        """Record one event from ``t_start_ns`` to ``t_end_ns``, if tracing is on.

        Args:
            kind: what happened ("send", "bucket", "forward", ...).
            t_start_ns: its start, from ``now()``.
            t_end_ns: its end.
            **fields: the event's other fields (peer, bytes, chunk, round, algorithm, ...).
        """
        if self.enabled:
            if "thread" not in fields and threading.current_thread() is not threading.main_thread():
                fields["thread"] = "comm"
            self.events.append(Event(self.rank, kind, t_start_ns, t_end_ns, **fields))

    def span(self, kind: str, **fields: Any) -> AbstractContextManager[None]:
        """Records ``kind`` around the block; when off, one shared do-nothing context, so a tracer
        that is off builds no generator per span.

        Args:
            kind: what the block does.
            **fields: the event's other fields.

        Returns:
            A context manager.
        """
        return self._span(kind, fields) if self.enabled else _OFF

    @contextmanager
    def _span(self, kind: str, fields: dict[str, Any]) -> Iterator[None]:
        t0 = self.now()
        try:
            yield
        finally:
            self.record(kind, t0, self.now(), **fields)

    def take(self) -> list[Event]:
        """Hand over the events recorded so far and start afresh.

        Returns:
            The events.
        """
        events, self.events = self.events, []
        return events


def align_clock(comm: Any, samples: int = 8) -> int:
    """Set ``comm.tracer.offset_ns`` so that every rank's clock reads like rank 0's.

    Cristian's algorithm: rank 0 stamps t0, the peer answers with its clock t1, rank 0
    stamps t2; the peer's offset is t1 - (t0 + t2) / 2, taken from the sample with the
    shortest round trip (the least queueing noise).

    Args:
        comm: the communicator, every rank calling.
        samples: round trips per peer.

    Returns:
        This rank's offset in nanoseconds (0 on rank 0).
    """
    stamp = np.zeros(1, dtype=np.int64)
    if comm.rank == 0:
        for peer in range(1, comm.world_size):
            best = None
            for _ in range(samples):
                t0 = time.perf_counter_ns()
                comm.send(stamp, peer)
                comm.recv(stamp, peer)
                t2 = time.perf_counter_ns()
                if best is None or t2 - t0 < best[0]:
                    best = (t2 - t0, int(stamp[0]) - (t0 + t2) // 2)
            stamp[0] = best[1]
            comm.send(stamp, peer)
    else:
        for _ in range(samples):
            comm.recv(stamp, 0)
            stamp[0] = time.perf_counter_ns()
            comm.send(stamp, 0)
        comm.recv(stamp, 0)
    comm.tracer.offset_ns = -int(stamp[0]) if comm.rank else 0
    return comm.tracer.offset_ns


def merge(per_rank: Iterable[Iterable[Event]]) -> list[Event]:
    """One time-ordered list from every rank's events.

    Args:
        per_rank: each rank's events.

    Returns:
        All events, by start time then rank.
    """
    return sorted((e for events in per_rank for e in events), key=lambda e: (e.t_start_ns, e.rank))


def save_json(path: str | Path, events: Iterable[Event], meta: dict[str, Any] | None = None,
              what: str = "trace") -> None:
    """Write the events (and ``meta``) as JSON, whole or not at all (``WriteError`` in one line).

    Args:
        path: the file.
        events: the events.
        meta: anything JSON can hold, saved beside them.
        what: what the file is, for the message.

    Raises:
        WriteError: the file cannot be written.
    """
    from dplab.reference.files import write_atomic  # loaded by the runs that write a trace

    doc = {"meta": meta or {}, "events": [asdict(e) for e in events]}
    write_atomic(path, json.dumps(doc).encode(), what)


def load_json(path: str | Path) -> tuple[list[Event], dict[str, Any]]:
    """Read what ``save_json`` wrote.

    Args:
        path: the file.

    Returns:
        (events, meta).
    """
    doc = json.loads(Path(path).read_text())
    return [Event(**e) for e in doc["events"]], doc.get("meta", {})


def to_chrome(events: Iterable[Event], cluster: str = "") -> dict[str, Any]:
    """Chrome-trace JSON: one process per rank, one thread row per rank thread. ``cluster``: the
    events are a simulated cluster's virtual time (the sim backend), and every rank says so.

    Args:
        events: the events.
        cluster: the simulated cluster's name, or "" for wall time.

    Returns:
        A dict ``json.dump`` writes as a trace for chrome://tracing or Perfetto.
    """
    events = list(events)
    t0 = min((e.t_start_ns for e in events), default=0)
    threads = sorted({(e.rank, e.thread) for e in events})
    tid = {key: i for i, key in enumerate(threads)}
    out: list[dict[str, Any]] = []
    for rank in sorted({r for r, _ in threads}):
        name = f"rank {rank}" + (f" (simulated: {cluster})" if cluster else "")
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}})
    for (rank, thread), i in tid.items():
        out.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": thread}}
        )
    for e in events:
        hidden = ("rank", "t_start_ns", "t_end_ns", "thread")
        args = {k: v for k, v in asdict(e).items() if k not in hidden}
        arrow = "->" if e.kind == "send" else "<-"
        out.append({
            "name": e.kind if e.peer < 0 else f"{e.kind} {arrow} {e.peer}",
            "cat": e.algorithm or e.kind, "ph": "X", "pid": e.rank, "tid": tid[(e.rank, e.thread)],
            "ts": (e.t_start_ns - t0) / 1e3, "dur": max(e.t_end_ns - e.t_start_ns, 0) / 1e3,
            "args": args,
        })
    doc = {"traceEvents": out, "displayTimeUnit": "ns"}
    if cluster:
        doc["otherData"] = {"clock": f"simulated time on {cluster}"}
    return doc
