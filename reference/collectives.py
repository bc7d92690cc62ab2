"""Run any schedule over any Communicator, in place.

    from dplab.reference.collectives import allreduce
    allreduce(comm, grads, algorithm="ring", op="mean")   # every rank, same buffer shape

The executor knows nothing about rings or trees: it looks up the schedule, cuts the
flat buffer into the schedule's chunks, and for each round hands this rank's sends
and receives to ``comm.exchange``. A rank whose buffer differs from its peers' gets a
``BufferMismatch``, not a hang, and one that called another collective, algorithm or root a
``CollectiveMismatch``: ``comm.check_buffer(buf, call)`` tells the backend what this rank
called, and every message carries it (its tag) and is checked against the buffer it lands in
(empty chunks, n < p, still travel as zero-length messages), or, where the transport cannot
do that cheaply (gloo), the collective's first message on each link carries it once.

Dtypes: float16, float32, float64, int32, int64 everywhere; torch.bfloat16 tensors on the torch
backend (numpy has no bfloat16, so the local and MPI backends, which move numpy arrays, cannot
carry it). The accumulation rule for half types is the buffer's own precision, as NCCL does:
every partial sum is rounded to the buffer's dtype before it travels on, so a float16 sum over p
ranks is p-1 additions, each rounded (unit roundoff u = 2**-11; bfloat16 2**-8). Its error, for
any algorithm and any order of additions, is at most ``(p-1) u / (1 - (p-1) u) * sum_r |x_r|``
per element (Higham's bound for recursive summation); ``op="mean"`` adds one rounding more. Which
order the additions take depends on the algorithm and the chunk (gloo's float16 all-reduce of
1, 2**-11, 2**-11 on three ranks gives 1.0 for one element and 1.0009765625 for another), so
half-precision results agree across ranks bit for bit but not with another algorithm's. A sum
past the dtype's largest value (65504 for float16) is inf: that is how loss scaling
(``dplab.reference.precision``) sees an overflow on every rank at once.
"""

from __future__ import annotations

import threading
import weakref
from functools import lru_cache
from typing import Any

import numpy as np

from dplab.reference import auto
from dplab.reference.algorithms import ROOTED, SCATTER, allreduce_schedule, lookup
from dplab.reference.communicator import Collective, Communicator, RecvSpec, SendSpec, require_writable
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Message, Schedule, chunk_bounds, messages_of

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "run_schedule", "schedule_plan"]

_DTYPES = ("float16", "float32", "float64", "int32", "int64")  # numpy arrays, on every backend
_TORCH_DTYPES = (*_DTYPES, "bfloat16")  # torch tensors, on the torch backend
_NUMPY_DTYPES = frozenset(np.dtype(t) for t in _DTYPES)

Plan = list[tuple[list[Message], list[Message]]]  # per round, this rank's (sends, receives)


def run_schedule(comm: Communicator, buf: Any, schedule: Schedule, plan: Plan | None = None) -> None:
    """Execute ``schedule`` on this rank's ``buf`` (1-D, contiguous array or tensor), round by round.

    A round's chunks to one peer that are consecutive go as one message (``messages_of``). A
    message of chunks this rank also receives into in the same round (recursive doubling's
    exchange) is sent from a snapshot: zero-copy transports read the sent memory while the
    receive adds into it. Schedules without such exchanges send straight out of ``buf``."""
    plan = plan if plan is not None else messages_of(schedule, comm.rank)
    name, new = schedule.name, tuple.__new__  # a NamedTuple's own __new__ costs twice as much
    for k, sends, recvs, snap in _rounds(plan, len(buf), schedule.num_chunks):
        if snap:
            scratch = _snapshot(comm, buf, snap)
            out = [new(SendSpec, (buf[s] if at < 0 else scratch[at:at + s.stop - s.start], d, c))
                   for s, d, c, at in sends]
        else:
            out = [new(SendSpec, (buf[s], d, c)) for s, d, c, _ in sends]
        comm.exchange(out, [new(RecvSpec, (buf[s], src, c, red)) for s, src, c, red in recvs],
                      round=k, algorithm=name)


_ROUNDS: dict[tuple[int, int, int], tuple[Plan, list]] = {}  # (id(plan), n, chunks) -> (plan, rounds)


def _rounds(plan: Plan, n: int, num_chunks: int) -> list:
    """The plan's non-empty rounds with each message's slice of an ``n``-element buffer worked out
    once per (plan, n): (round, [(slice, dst, chunk, snapshot offset or -1)], [(slice, src, chunk,
    reduce)], snapshot spans). Chunk bounds, spans and snapshot layout cost more Python than a small
    all-reduce's data (~2 µs a call); a span sent to several peers is copied once."""
    hit = _ROUNDS.get((id(plan), n, num_chunks))
    if hit is not None and hit[0] is plan:
        return hit[1]
    bounds = chunk_bounds(n, num_chunks)
    span = lambda m: slice(bounds[m.chunk][0], bounds[m.stop - 1][1])  # noqa: E731
    rounds = []
    for k, (sends, recvs) in enumerate(plan):
        if not sends and not recvs:
            continue
        snap: dict[tuple[int, int], int] = {}  # (start, stop) of a snapshot span -> its offset in scratch
        out = []
        for m in sends:
            s, at = span(m), -1
            if m.snapshot:
                at = snap.setdefault((s.start, s.stop), sum(b - a for a, b in snap))
            out.append((s, m.dst, m.chunk, at))
        rounds.append((k, out, [(span(m), m.src, m.chunk, m.op == "reduce") for m in recvs],
                       tuple(snap.items())))
    if len(_ROUNDS) >= 4096:
        _ROUNDS.clear()
    _ROUNDS[id(plan), n, num_chunks] = (plan, rounds)
    return rounds


_SCRATCH = threading.local()  # per thread (DDP's comm thread has its own): id(comm) -> (ref, scratches)


def _snapshot(comm: Communicator, buf: Any, spans: tuple) -> Any:
    """Scratch from ``comm.empty`` (shared memory on the local backend, so the copy itself still goes
    without staging) holding a copy of each span sent from a snapshot, at its offset (``spans``:
    ((start, stop), offset) pairs, offsets ascending). The scratch is kept per communicator and
    reused: a round's sends are done when ``exchange`` returns. Its bytes count as the transport's
    staged bytes where it counts them (local)."""
    (start, stop), at = spans[-1]
    total = at + stop - start
    scratch = _scratch(comm, buf, total)
    numpy = isinstance(buf, np.ndarray)
    for (start, stop), at in spans:
        if numpy:
            np.copyto(scratch[at:at + stop - start], buf[start:stop])  # half the cost of [:]= at 4 KiB
        else:
            scratch[at:at + stop - start].copy_(buf[start:stop])
    if hasattr(comm, "bytes_staged"):
        comm.bytes_staged += total * (buf.itemsize if numpy else buf.element_size())
    return scratch


def _scratch(comm: Communicator, buf: Any, n: int) -> Any:
    """At least ``n`` elements of ``buf``'s dtype (and device), grown as needed, then reused. Kept
    by ``id(comm)`` with a weak reference to check it (a WeakKeyDictionary look-up costs ~0.5 µs)."""
    cache = getattr(_SCRATCH, "by_comm", None)
    if cache is None:
        cache = _SCRATCH.by_comm = {}
    entry = cache.get(id(comm))
    if entry is None or entry[0]() is not comm:
        for dead in [k for k, (ref, _) in cache.items() if ref() is None]:
            del cache[dead]
        entry = cache[id(comm)] = (weakref.ref(comm), {})
    mine = entry[1]
    key = (buf.dtype, getattr(buf, "device", None))  # as they are: str() of a dtype costs ~10 µs
    have = mine.get(key)
    if have is None or len(have) < n:
        have = mine[key] = comm.empty(n, buf.dtype) if isinstance(buf, np.ndarray) else buf.new_empty(n)
    return have


@lru_cache(maxsize=1024)
def schedule_plan(kind: str, algorithm: str, p: int, rank: int, root: int = 0) -> tuple[Schedule, Plan]:
    """The schedule of a collective and this rank's part of it: (sends, receives) per round."""
    if kind == "allreduce":
        s = allreduce_schedule(algorithm, p)
    elif kind in ("reduce_scatter", "allgather"):
        pair, extra = lookup(SCATTER, algorithm, kind)
        s = pair[kind == "allgather"](p, *extra)
    else:
        pair, extra = lookup(ROOTED, algorithm, kind)
        s = pair[kind == "broadcast"](p, root, *extra)
    return s, messages_of(s, rank)


def _flat(buf: Any, backend: str = "") -> Any:
    """A 1-D view of ``buf``: a numpy array, or a torch tensor (duck-typed: reference imports no torch)."""
    if isinstance(buf, np.ndarray):
        flags = buf.flags  # one flags object for both checks
        if not flags.writeable:
            require_writable(buf)  # refused on every rank before any message, not half-way on one
        if buf.dtype not in _NUMPY_DTYPES and buf.dtype.name not in _DTYPES:  # .name costs ~2 µs
            raise ConfigError(f"dtype {buf.dtype} not supported: use {', '.join(_DTYPES)} (numpy has no "
                              "bfloat16: pass a torch.bfloat16 tensor on the torch backend)")
        if not flags.c_contiguous:
            raise ConfigError("collectives work in place on contiguous arrays: use np.ascontiguousarray")
        return buf.reshape(-1)
    if type(buf).__module__.startswith("torch"):
        if str(buf.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
            raise ConfigError(f"dtype {buf.dtype} not supported: use {', '.join(_TORCH_DTYPES)}")
        if backend in ("local", "mpi"):
            raise ConfigError(f"torch tensors travel on the torch backend; the {backend} backend moves "
                              "numpy arrays: pass t.numpy() (a CPU tensor shares its memory) or use "
                              "backend='torch' (bfloat16 only there: numpy has no bfloat16)")
        if not buf.is_contiguous():
            raise ConfigError("collectives work in place on contiguous tensors: pass t.contiguous()")
        return buf.view(-1)
    raise ConfigError(f"collectives take numpy arrays (or torch tensors), got {type(buf).__name__}")


def _is_float(buf: Any) -> bool:
    dtype = buf.dtype
    return dtype.kind == "f" if isinstance(dtype, np.dtype) else bool(dtype.is_floating_point)


_CALLS: dict[tuple, tuple[Schedule, Plan, Collective]] = {}  # (kind, algorithm, p, rank, root) -> ...


def _run(comm: Communicator, kind: str, buf: Any, algorithm: str, root: int | None = None,
         flat: Any = None) -> Any:
    """Run one collective on ``buf`` (``flat``: its 1-D view, when the caller has checked it already).
    The schedule, this rank's plan and the ``Collective`` it announces are looked up once per call
    signature (building them cost ~1.5 µs a call); a tracer that is off costs no span."""
    if flat is None:
        flat = _flat(buf, getattr(comm, "backend", ""))
    p, rank = comm.world_size, comm.rank
    if root is not None and not 0 <= root < p:
        raise ConfigError(f"root {root} is not a rank of a world of size {p}")
    call = _CALLS.get((kind, algorithm, p, rank, root))
    if call is None:
        schedule, plan = schedule_plan(kind, algorithm, p, rank, root or 0)
        if len(_CALLS) >= 4096:
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


def allreduce(comm: Communicator, buf: np.ndarray, algorithm: str = "ring", op: str = "sum") -> np.ndarray:
    """Sum (or average, ``op="mean"``) ``buf`` across all ranks, in place; returns ``buf``.
    ``algorithm="auto"`` runs what the fitted cost model prices cheapest for this size (``auto``).

    float16 and bfloat16 add in their own precision, each partial sum rounded (module docstring)."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    flat = _flat(buf, getattr(comm, "backend", ""))
    if op == "mean" and not _is_float(buf):
        raise ConfigError(f"op='mean' needs a floating-point buffer, got {buf.dtype}: use op='sum'")
    if algorithm == "auto":  # the one place auto resolves (reference/auto.py); the trace names the choice
        algorithm = auto.chosen(comm, buf)
    if algorithm == "native":
        with comm.tracer.span("allreduce", bytes=flat.nbytes, algorithm="native"):
            comm.native_allreduce(flat, "sum")
    else:
        _run(comm, "allreduce", buf, algorithm, flat=flat)
    if op == "mean" and comm.world_size > 1:
        flat /= comm.world_size
    return buf


def reduce_scatter(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """Afterwards this rank's chunk (``chunk_bounds(n, p)[rank]``) holds the sum; returns a view of it."""
    flat = _run(comm, "reduce_scatter", buf, algorithm)
    return flat[slice(*chunk_bounds(len(flat), comm.world_size)[comm.rank])]


def allgather(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """Every rank contributes its own chunk of ``buf``; afterwards all hold all chunks."""
    _run(comm, "allgather", buf, algorithm)
    return buf


def broadcast(comm: Communicator, buf: np.ndarray, root: int = 0, algorithm: str = "tree") -> np.ndarray:
    _run(comm, "broadcast", buf, algorithm, root)
    return buf


def reduce(comm: Communicator, buf: np.ndarray, root: int = 0, algorithm: str = "tree") -> np.ndarray:
    """Afterwards ``root`` holds the sum; other ranks' buffers hold partial sums (scratch)."""
    _run(comm, "reduce", buf, algorithm, root)
    return buf
