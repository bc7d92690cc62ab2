"""Files that arrive from someone else: bench rows and traces, checked before anything uses them.

    from dplab.backends.runs.uploads import bench_rows, trace
    rows = bench_rows(path.read_bytes(), "bench.json")   # tune --from-json, the app's Cost page
    events, meta = trace(upload.getvalue())              # the app's Runs page

A file that is not what ``dplab bench --json`` or ``dplab train --trace`` writes is refused with
one ``ConfigError`` line, before any work: too large, not JSON, nested too deep, a value of the
wrong type, a number out of range. Ranges are what the consumers can afford, not what a writer
could produce: every bench row's schedule is built at its world size (``costfit.terms``), so a
``"world_size": 1000000000`` must stop here, and a trace is drawn one bar per event.

Pure: json and the trace's ``Event``; ``dplab tune`` and the app (``viz``) both import this.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from dplab.reference import costfit
from dplab.reference.errors import ConfigError
from dplab.reference.trace import Event

__all__ = ["BenchLimits", "TraceLimits", "BENCH", "TRACE", "bench_rows", "trace", "parse_json"]


@dataclass(frozen=True)
class BenchLimits:
    """What a bench file may hold: more than a real ``dplab bench --json``, far less than a fit
    chokes on.

    Attributes:
        max_bytes: the file's size.
        max_rows: rows.
        max_world_size: the largest world size of a row.
        max_world_sizes: distinct world sizes (each builds every schedule once).
        max_nbytes: a row's ``bytes``.
        max_time_us: a row's ``time_us``.
        max_text: characters of a backend's or an algorithm's name.
    """

    max_bytes: int = 1 << 20
    max_rows: int = 4000
    max_world_size: int = 128
    max_world_sizes: int = 16  # distinct world sizes: each builds every schedule once
    max_nbytes: int = 1 << 40
    max_time_us: float = 1e12
    max_text: int = 64  # backend and algorithm names


@dataclass(frozen=True)
class TraceLimits:
    """What a trace may hold: ``dplab train --trace`` of the app's largest run is ~75k events,
    14 MB.

    Attributes:
        max_bytes: the file's size.
        max_events: events.
        max_rank: the largest rank of an event.
        max_text: characters of a kind, an algorithm or a thread's name.
        max_extra: keys of an event's extra.
    """

    max_bytes: int = 64 << 20
    max_events: int = 250_000
    max_rank: int = 1023
    max_text: int = 64  # kind, algorithm, thread
    max_extra: int = 16  # keys of an event's extra


BENCH, TRACE = BenchLimits(), TraceLimits()
_NUMBER = (int, float)
_SCALAR = (str, int, float, bool, type(None))
_ROW_TYPES = {"backend": str, "algorithm": str, "world_size": int, "bytes": int, "time_us": _NUMBER}


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a number out of range ({text[:20]})")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 18:  # past int64: no counter or size of ours
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(data: str | bytes, name: str, max_bytes: int, what: str) -> Any:
    """``data`` as JSON, or one line: too large, not UTF-8 JSON, nested too deep, a huge number.

    Args:
        data: the file's content.
        name: what to call it in an error.
        max_bytes: the most ``data`` may hold.
        what: what the file should be, for the error's advice.

    Returns:
        The parsed JSON.

    Raises:
        ConfigError: ``data`` is too large, not JSON, nested too deep, or holds a number out of
            range.
    """
    if len(data) > max_bytes:
        raise ConfigError(f"{name} is {len(data):,} bytes, more than the {max_bytes:,} "
                          f"this accepts: give {what}")
    try:
        return json.loads(data, parse_float=_finite, parse_int=_int, parse_constant=_finite)
    except RecursionError:
        raise ConfigError(f"{name} is nested too deep to be {what}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name} is not JSON ({str(e)[:120]}): give {what}") from None


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def bench_rows(data: str | bytes, name: str = "bench JSON",
               limits: BenchLimits = BENCH) -> list[dict[str, Any]]:
    """The rows of a ``dplab bench --json`` file ({"meta", "rows"} or a bare list), checked
    whole.

    Args:
        data: the file's content.
        name: what to call it in an error.
        limits: what the file may hold.

    Returns:
        The rows, each ``{backend, algorithm, world_size, bytes, time_us, ...}``.

    Raises:
        ConfigError: the first thing wrong with the file: its size, JSON, shape, a row's field or
            value, the number of rows or world sizes.
    """
    what = "a file written by `dplab bench --json`"
    doc = parse_json(data, name, limits.max_bytes, what)
    rows = costfit.load_bench_json(json.dumps(doc), name)  # its shape, in costfit's own words
    if len(rows) > limits.max_rows:
        raise ConfigError(f"{name} has {len(rows):,} rows, more than the {limits.max_rows:,} "
                          "this fits: give fewer sizes or algorithms")
    for i, r in enumerate(rows):
        for key, kind in _ROW_TYPES.items():
            if not _is(r[key], kind):
                raise ConfigError(f"{name}: row {i}'s {key} is {type(r[key]).__name__}, not "
                                  f"{'a number' if kind is _NUMBER else kind.__name__}: "
                                  f"give {what}")
        for key in ("backend", "algorithm"):
            if not 0 < len(r[key]) <= limits.max_text:
                raise ConfigError(f"{name}: row {i}'s {key} must be "
                                  f"1..{limits.max_text} characters")
        bad = next((k for k, v in r.items() if not isinstance(v, _SCALAR)
                    or (isinstance(v, str) and len(v) > limits.max_text)), None)
        if bad is not None:
            raise ConfigError(f"{name}: row {i}'s {bad[:limits.max_text]!r} must be a "
                              "number, short text or null")
        checks = (("world_size", 1, limits.max_world_size), ("bytes", 0, limits.max_nbytes),
                  ("time_us", 0, limits.max_time_us))
        for key, lo, hi in checks:
            if not lo <= r[key] <= hi:
                raise ConfigError(f"{name}: row {i}'s {key} {r[key]:g} is outside "
                                  f"{lo:g}..{hi:g}, what this fits: give {what}")
    sizes = {r["world_size"] for r in rows}
    if len(sizes) > limits.max_world_sizes:
        raise ConfigError(f"{name} has {len(sizes)} world sizes, more than the "
                          f"{limits.max_world_sizes} this fits at once: split it")
    return rows


_EVENT_TYPES = {f.name: str if f.type in ("str", str) else dict if f.name == "extra" else int
                for f in fields(Event)}


def trace(data: str | bytes, limits: TraceLimits = TRACE) -> tuple[list[Event], dict[str, Any]]:
    """The events and meta of a ``dplab train --trace PATH`` file, checked whole (meta's ``row``
    keeps only scalar values: the page prints them).

    Args:
        data: the file's content.
        limits: what the file may hold.

    Returns:
        ``(events, meta)``: the trace's events, and its meta object.

    Raises:
        ConfigError: the first thing wrong with the file: its size, JSON, shape, an event's
            fields, or no events at all.
    """
    def refuse(detail: str) -> ConfigError:
        return ConfigError(f"not a dplab trace file ({detail}): load the PATH written by "
                           "`dplab train --trace PATH` (not its .chrome.json, which is "
                           "for Perfetto)")

    try:
        doc = parse_json(data, "it", limits.max_bytes, "a trace")
    except ConfigError as e:
        raise refuse(str(e)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise refuse("no list of events")
    raw, meta = doc["events"], doc.get("meta", {})
    if not isinstance(meta, dict):
        raise refuse("its meta is not an object")
    if len(raw) > limits.max_events:
        raise ConfigError(f"the trace file has {len(raw):,} events, more than the "
                          f"{limits.max_events:,} this draws: record a shorter run")
    required = {"rank", "kind", "t_start_ns", "t_end_ns"}
    events = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict) or not required <= set(e) or not set(e) <= set(_EVENT_TYPES):
            raise refuse(f"event {i} is not an object of rank, kind, t_start_ns, t_end_ns, ...")
        for key, value in e.items():
            kind = _EVENT_TYPES[key]
            if not _is(value, kind) or (kind is str and len(value) > limits.max_text):
                must = ("short text" if kind is str else "an object" if kind is dict
                        else "an integer")
                raise refuse(f"event {i}'s {key} must be {must}")
        if not 0 <= e["rank"] <= limits.max_rank or e["t_end_ns"] < e["t_start_ns"]:
            raise refuse(f"event {i} has rank {e['rank']} (0..{limits.max_rank}) or ends before "
                         "it starts")
        extra = e.get("extra", {})
        if len(extra) > limits.max_extra or not all(isinstance(v, _SCALAR) and not (
                isinstance(v, str) and len(v) > limits.max_text) for v in extra.values()):
            raise refuse(f"event {i}'s extra must hold at most {limits.max_extra} numbers or "
                         "short texts")
        events.append(Event(**e))
    if not events:
        raise ConfigError("the trace file holds no events: record one with `dplab train "
                          "--trace PATH`")
    row = meta.get("row", {})
    meta = {**meta, "row": {k: v for k, v in row.items() if isinstance(v, _SCALAR) and not (
        isinstance(v, str) and len(v) > 200)} if isinstance(row, dict) else {}}
    return events, meta
