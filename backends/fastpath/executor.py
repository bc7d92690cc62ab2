"""The engine's executor: the spine's collectives (``dplab.reference.collectives``) with the work
that does not depend on the data done once.

Same signatures, same schedules, same messages in the same order, same bits in every buffer
(``tests/test_spine_equals_engine.py``). What it keeps between calls:

- per call signature (kind, algorithm, p, rank, root): the schedule, this rank's plan and the
  ``Collective`` it announces;
- per (plan, buffer length): each message's slice of the buffer and the snapshot layout;
- per communicator, thread, dtype and device: one scratch buffer for snapshots, from
  ``comm.empty`` (shared memory on the local backend, so a snapshot is sent without staging).

Used where per-call overhead shows (``dplab.backends.fastpath``).
"""

from __future__ import annotations

import threading
import weakref
from functools import lru_cache
from typing import Any

import numpy as np

from dplab.reference import collectives as spine
from dplab.reference.communicator import (
    Collective,
    Communicator,
    RecvSpec,
    SendSpec,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Message, Schedule, chunk_bounds, messages_of

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "run_schedule",
           "schedule_plan", "Plan"]

_NUMPY_DTYPES = frozenset(np.dtype(t) for t in spine.DTYPES)
_LIMIT = 4096  # entries per cache before it is emptied: bounds memory, never correctness

Plan = list[tuple[list[Message], list[Message]]]  # per round, this rank's (sends, receives)

schedule_plan = lru_cache(maxsize=1024)(spine.schedule_plan)


def run_schedule(comm: Communicator, buf: Any, schedule: Schedule,
                 plan: Plan | None = None) -> None:
    """``dplab.reference.collectives.run_schedule``, with ``plan`` (``messages_of(schedule, rank)``)
    given or worked out, and the slices of each round looked up instead of recomputed."""
    plan = plan if plan is not None else messages_of(schedule, comm.rank)
    name, new = schedule.name, tuple.__new__  # NamedTuple construction without its checking wrapper
    for k, sends, recvs, snap in _rounds(plan, len(buf), schedule.num_chunks):
        if snap:
            scratch = _snapshot(comm, buf, snap)
            out = [new(SendSpec, (buf[s] if at < 0 else scratch[at:at + s.stop - s.start], d, c))
                   for s, d, c, at in sends]
        else:
            out = [new(SendSpec, (buf[s], d, c)) for s, d, c, _ in sends]
        comm.exchange(out, [new(RecvSpec, (buf[s], src, c, red)) for s, src, c, red in recvs],
                      round=k, algorithm=name)


# (id(plan), n, chunks) -> (plan, rounds)
_ROUNDS: dict[tuple[int, int, int], tuple[Plan, list]] = {}


def _rounds(plan: Plan, n: int, num_chunks: int) -> list:
    """The plan's non-empty rounds with each message's slice of an ``n``-element buffer worked out
    once per (plan, n): (round, [(slice, dst, chunk, snapshot offset or -1)], [(slice, src, chunk,
    reduce)], snapshot spans). A span sent to several peers is copied once. The plan itself is kept
    in the entry, so its id cannot be reused while the entry lives."""
    hit = _ROUNDS.get((id(plan), n, num_chunks))
    if hit is not None and hit[0] is plan:
        return hit[1]
    bounds = chunk_bounds(n, num_chunks)
    span = lambda m: slice(bounds[m.chunk][0], bounds[m.stop - 1][1])  # noqa: E731
    rounds = []
    for k, (sends, recvs) in enumerate(plan):
        if not sends and not recvs:
            continue
        # (start, stop) of a snapshot span -> its offset in scratch
        snap: dict[tuple[int, int], int] = {}
        out = []
        for m in sends:
            s, at = span(m), -1
            if m.snapshot:
                at = snap.setdefault((s.start, s.stop), sum(b - a for a, b in snap))
            out.append((s, m.dst, m.chunk, at))
        rounds.append((k, out, [(span(m), m.src, m.chunk, m.op == "reduce") for m in recvs],
                       tuple(snap.items())))
    if len(_ROUNDS) >= _LIMIT:
        _ROUNDS.clear()
    _ROUNDS[id(plan), n, num_chunks] = (plan, rounds)
    return rounds


# per thread (DDP's comm thread has its own): id(comm) -> (ref, scratches)
_SCRATCH = threading.local()


def _snapshot(comm: Communicator, buf: Any, spans: tuple) -> Any:
    """Scratch holding a copy of each span sent from a snapshot, at its offset (``spans``:
    ((start, stop), offset) pairs, offsets ascending). The scratch is reused: a round's sends are
    done when ``exchange`` returns. Its bytes count as the transport's staged bytes where it counts
    them (local), as the copy the spine sends would be staged."""
    (start, stop), at = spans[-1]
    total = at + stop - start
    scratch = _scratch(comm, buf, total)
    numpy = isinstance(buf, np.ndarray)
    for (start, stop), at in spans:
        if numpy:
            np.copyto(scratch[at:at + stop - start], buf[start:stop])
        else:
            scratch[at:at + stop - start].copy_(buf[start:stop])
    if hasattr(comm, "bytes_staged"):
        comm.bytes_staged += total * (buf.itemsize if numpy else buf.element_size())
    return scratch


def _scratch(comm: Communicator, buf: Any, n: int) -> Any:
    """At least ``n`` elements of ``buf``'s dtype (and device), grown as needed, then reused. Kept
    by ``id(comm)`` with a weak reference that tells a reused id from the communicator it named."""
    cache = getattr(_SCRATCH, "by_comm", None)
    if cache is None:
        cache = _SCRATCH.by_comm = {}
    entry = cache.get(id(comm))
    if entry is None or entry[0]() is not comm:
        for dead in [k for k, (ref, _) in cache.items() if ref() is None]:
            del cache[dead]
        entry = cache[id(comm)] = (weakref.ref(comm), {})
    mine = entry[1]
    key = (buf.dtype, getattr(buf, "device", None))
    have = mine.get(key)
    if have is None or len(have) < n:
        have = mine[key] = (
            comm.empty(n, buf.dtype) if isinstance(buf, np.ndarray) else buf.new_empty(n)
        )
    return have


def _flat(buf: Any, comm: Communicator) -> Any:
    """``spine.flat_view`` with the common case (a writable, contiguous numpy array of a known
    dtype) decided from one flags object and a set look-up; anything else goes to the spine's."""
    if isinstance(buf, np.ndarray):
        flags = buf.flags
        if flags.writeable and flags.c_contiguous and buf.dtype in _NUMPY_DTYPES:
            return buf.reshape(-1)
        require_writable(buf)
    return spine.flat_view(buf, comm)


# (kind, algorithm, p, rank, root) -> ...
_CALLS: dict[tuple, tuple[Schedule, Plan, Collective]] = {}


def _run(comm: Communicator, kind: str, buf: Any, algorithm: str, root: int | None = None,
         flat: Any = None) -> Any:
    """Run one collective on ``buf`` (``flat``: its 1-D view, when the
    caller has checked it already)."""
    if flat is None:
        flat = _flat(buf, comm)
    p, rank = comm.world_size, comm.rank
    if root is not None and not 0 <= root < p:
        raise ConfigError(f"root {root} is not a rank of a world of size {p}")
    call = _CALLS.get((kind, algorithm, p, rank, root))
    if call is None:
        schedule, plan = schedule_plan(kind, algorithm, p, rank, root or 0)
        if len(_CALLS) >= _LIMIT:
            _CALLS.clear()
        call = _CALLS[kind, algorithm, p, rank, root] = (
            schedule, plan, Collective(kind, algorithm, -1 if root is None else root))
    schedule, plan, collective = call
    if comm.tracer.enabled:
        with comm.tracer.span(kind, bytes=flat.nbytes, algorithm=algorithm):
            comm.check_buffer(flat, collective)
            run_schedule(comm, flat, schedule, plan)
    else:
        comm.check_buffer(flat, collective)
        run_schedule(comm, flat, schedule, plan)
    return flat


def allreduce(comm: Communicator, buf: np.ndarray, algorithm: str = "ring",
              op: str = "sum") -> np.ndarray:
    """``dplab.reference.collectives.allreduce``; "auto" is resolved here by ``auto.chosen`` and
    ``hierarchical`` on the hosts by ``layout.resolve`` (the spine's executor takes names as given).

    Args:
        comm: this rank's communicator.
        buf: a writable, contiguous numpy array (or a torch tensor, on a backend that moves
            them) of the same length and dtype on every rank; worked on in place.
        algorithm: a schedule's name (``"ring"``, ``"pipelined_tree:16"``, ...), ``"native"``
            (the engine's own all-reduce) or ``"auto"`` (the fitted cost model's cheapest).
        op: ``"sum"``, or ``"mean"`` (floating-point buffers only) to divide by the world size.

    Returns:
        ``buf``, holding the sum (or mean) over all ranks.

    Raises:
        ConfigError: an unknown ``op`` or algorithm, ``op="mean"`` on an integer buffer, or a
            buffer the collectives cannot work on in place (read-only, non-contiguous, a dtype
            they do not move).
        CollectiveMismatch: a peer is in another collective, algorithm or root.
        BufferMismatch: a peer's buffer has another length or dtype.
        CommTimeout: a peer did not answer within ``comm.timeout``.
    """
    if op not in ("sum", "mean"):
        raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    flat = _flat(buf, comm)
    if op == "mean" and not spine.is_float(buf):
        raise ConfigError(f"op='mean' needs a floating-point buffer, got {buf.dtype}: use op='sum'")
    if algorithm == "auto":  # the cost model loads for callers that ask for it, not on every import
        from dplab.reference.auto import chosen

        algorithm = chosen(comm, buf)
    # the layout loads with the registry: not on every import
    if algorithm.startswith("hierarchical"):
        from dplab.reference.algorithms.layout import resolve

        algorithm = resolve(algorithm, getattr(comm, "hosts", ()))
    if algorithm == "native":
        with comm.tracer.span("allreduce", bytes=flat.nbytes, algorithm="native"):
            comm.native_allreduce(flat, "sum")
    else:
        _run(comm, "allreduce", buf, algorithm, flat=flat)
    if op == "mean" and comm.world_size > 1:
        flat /= comm.world_size
    return buf


def reduce_scatter(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """``dplab.reference.collectives.reduce_scatter``: returns a view of this rank's chunk.

    Args:
        comm: this rank's communicator.
        buf: a writable, contiguous numpy array (or a torch tensor, on a backend that moves
            them) of the same length and dtype on every rank; worked on in place.
        algorithm: a schedule's name (default ``"ring"``).

    Returns:
        a view of this rank's chunk of ``buf`` (``chunk_bounds(n, p)[rank]``), holding the sum
        over all ranks of that chunk.

    Raises:
        ConfigError: an unknown algorithm, a buffer the collectives cannot work on in place.
        CollectiveMismatch: a peer is in another collective, algorithm or root.
        BufferMismatch: a peer's buffer has another length or dtype.
        CommTimeout: a peer did not answer within ``comm.timeout``.
    """
    flat = _run(comm, "reduce_scatter", buf, algorithm)
    return flat[slice(*chunk_bounds(len(flat), comm.world_size)[comm.rank])]


def allgather(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """``dplab.reference.collectives.allgather``.

    Args:
        comm: this rank's communicator.
        buf: a writable, contiguous numpy array (or a torch tensor, on a backend that moves
            them) of the same length and dtype on every rank; worked on in place.
        algorithm: a schedule's name (default ``"ring"``).

    Returns:
        ``buf``, holding every rank's chunk.

    Raises:
        ConfigError: an unknown algorithm, a buffer the collectives cannot work on in place.
        CollectiveMismatch: a peer is in another collective, algorithm or root.
        BufferMismatch: a peer's buffer has another length or dtype.
        CommTimeout: a peer did not answer within ``comm.timeout``.
    """
    _run(comm, "allgather", buf, algorithm)
    return buf


def broadcast(comm: Communicator, buf: np.ndarray, root: int = 0,
              algorithm: str = "tree") -> np.ndarray:
    """``dplab.reference.collectives.broadcast``.

    Args:
        comm: this rank's communicator.
        buf: a writable, contiguous numpy array (or a torch tensor, on a backend that moves
            them) of the same length and dtype on every rank; worked on in place.
        root: the rank whose ``buf`` every rank receives.
        algorithm: a schedule's name (default ``"tree"``).

    Returns:
        ``buf``, holding ``root``'s ``buf``.

    Raises:
        ConfigError: an unknown algorithm, a ``root`` that is not a rank of the world, or a
            buffer the collectives cannot work on in place.
        CollectiveMismatch: a peer is in another collective, algorithm or root.
        BufferMismatch: a peer's buffer has another length or dtype.
        CommTimeout: a peer did not answer within ``comm.timeout``.
    """
    _run(comm, "broadcast", buf, algorithm, root)
    return buf


def reduce(comm: Communicator, buf: np.ndarray, root: int = 0,
           algorithm: str = "tree") -> np.ndarray:
    """``dplab.reference.collectives.reduce``.

    Args:
        comm: this rank's communicator.
        buf: a writable, contiguous numpy array (or a torch tensor, on a backend that moves
            them) of the same length and dtype on every rank; worked on in place.
        root: the rank that ends holding the sum.
        algorithm: a schedule's name (default ``"tree"``).

    Returns:
        ``buf``: on ``root`` the sum over all ranks; elsewhere partial sums (scratch).

    Raises:
        ConfigError: an unknown algorithm, a ``root`` that is not a rank of the world, or a
            buffer the collectives cannot work on in place.
        CollectiveMismatch: a peer is in another collective, algorithm or root.
        BufferMismatch: a peer's buffer has another length or dtype.
        CommTimeout: a peer did not answer within ``comm.timeout``.
    """
    _run(comm, "reduce", buf, algorithm, root)
    return buf
