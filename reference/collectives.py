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
    for k, sends, recvs, spans, snapshot in _rounds(plan, len(buf), schedule.num_chunks):
        out = [buf[s] for s in spans]
        if snapshot:
            out = _snapshots(comm, buf, sends, out)
        comm.exchange([SendSpec(b, m.dst, m.chunk) for b, m in zip(out, sends)],
                      [RecvSpec(buf[s], m.src, m.chunk, m.op == "reduce") for s, m in recvs],
                      round=k, algorithm=schedule.name)


_ROUNDS: dict[tuple[int, int, int], tuple[Plan, list]] = {}  # (id(plan), n, chunks) -> (plan, rounds)


def _rounds(plan: Plan, n: int, num_chunks: int) -> list:
    """The plan's non-empty rounds with each message's slice of an ``n``-element buffer worked out
    once per (plan, n): (round, sends, [(slice, receive)], [send slice], any snapshot). Chunk
    bounds and message spans cost more Python than a small all-reduce's data (~2 µs a call)."""
    hit = _ROUNDS.get((id(plan), n, num_chunks))
    if hit is not None and hit[0] is plan:
        return hit[1]
    bounds = chunk_bounds(n, num_chunks)
    span = lambda m: slice(bounds[m.chunk][0], bounds[m.stop - 1][1])  # noqa: E731
    rounds = [(k, sends, [(span(m), m) for m in recvs], [span(m) for m in sends],
               any(m.snapshot for m in sends)) for k, (sends, recvs) in enumerate(plan) if sends or recvs]
    if len(_ROUNDS) >= 4096:
        _ROUNDS.clear()
    _ROUNDS[id(plan), n, num_chunks] = (plan, rounds)
    return rounds


_SCRATCH = threading.local()  # per thread (DDP's comm thread has its own): comm -> {dtype: scratch}


def _snapshots(comm: Communicator, buf: Any, sends: list[Message], out: list[Any]) -> list[Any]:
    """``out`` with each snapshot message replaced by a copy of it in scratch from ``comm.empty``
    (shared memory on the local backend, so the copy itself still goes without staging). The
    scratch is kept per communicator and reused: a round's sends are done when ``exchange``
    returns. Its bytes count as the transport's staged bytes where it counts them (local)."""
    spans: dict[tuple[int, int], Any] = {}  # one copy of a span sent to several peers
    for b, m in zip(out, sends):
        if m.snapshot:
            spans[m.chunk, m.stop] = b
    scratch, off = _scratch(comm, buf, sum(map(len, spans.values()))), 0
    for span, b in spans.items():
        spans[span] = copy = scratch[off:off + len(b)]
        if isinstance(b, np.ndarray):
            np.copyto(copy, b)  # half the cost of copy[:] = b at 4 KiB
        else:
            copy.copy_(b)
        off += len(b)
    if hasattr(comm, "bytes_staged"):
        comm.bytes_staged += off * (buf.itemsize if isinstance(buf, np.ndarray) else buf.element_size())
    return [spans[m.chunk, m.stop] if m.snapshot else b for b, m in zip(out, sends)]


def _scratch(comm: Communicator, buf: Any, n: int) -> Any:
    """At least ``n`` elements of ``buf``'s dtype (and device), grown as needed, then reused."""
    cache = getattr(_SCRATCH, "by_comm", None)
    if cache is None:
        cache = _SCRATCH.by_comm = weakref.WeakKeyDictionary()
    mine = cache.setdefault(comm, {})
    key = (buf.dtype, getattr(buf, "device", None))  # as they are: str() of a dtype costs ~10 µs
    have = mine.get(key)
    if have is None or len(have) < n:
        have = mine[key] = comm.empty(n, buf.dtype) if isinstance(buf, np.ndarray) else buf.new_empty(n)
    return have[:n]


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
        require_writable(buf)  # refused on every rank before any message, not half-way on one
        if buf.dtype not in _NUMPY_DTYPES and buf.dtype.name not in _DTYPES:  # .name costs ~2 µs
            raise ConfigError(f"dtype {buf.dtype} not supported: use {', '.join(_DTYPES)} (numpy has no "
                              "bfloat16: pass a torch.bfloat16 tensor on the torch backend)")
        if not buf.flags.c_contiguous:
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
    return buf.dtype.is_floating_point if hasattr(buf.dtype, "is_floating_point") else bool(
        np.issubdtype(buf.dtype, np.floating))


def _run(comm: Communicator, kind: str, buf: np.ndarray, algorithm: str, root: int | None = None
         ) -> np.ndarray:
    flat = _flat(buf, getattr(comm, "backend", ""))
    if root is not None and not 0 <= root < comm.world_size:
        raise ConfigError(f"root {root} is not a rank of a world of size {comm.world_size}")
    schedule, plan = schedule_plan(kind, algorithm, comm.world_size, comm.rank, root or 0)
    with comm.tracer.span(kind, bytes=flat.nbytes, algorithm=algorithm):
        comm.check_buffer(flat, Collective(kind, algorithm, -1 if root is None else root))
        run_schedule(comm, flat, schedule, plan)
    return flat


def allreduce(comm: Communicator, buf: np.ndarray, algorithm: str = "ring", op: str = "sum") -> np.ndarray:
    """Sum (or average, ``op="mean"``) ``buf`` across all ranks, in place; returns ``buf``.
    ``algorithm="auto"`` runs what the fitted cost model prices cheapest for this size (``auto``).

    float16 and bfloat16 add in their own precision, each partial sum rounded (module docstring)."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    _flat(buf, getattr(comm, "backend", ""))
    if op == "mean" and not _is_float(buf):
        raise ConfigError(f"op='mean' needs a floating-point buffer, got {buf.dtype}: use op='sum'")
    if algorithm == "auto":  # the one place auto resolves (reference/auto.py); the trace names the choice
        algorithm = auto.chosen(comm, buf)
    if algorithm == "native":
        flat = _flat(buf, getattr(comm, "backend", ""))
        with comm.tracer.span("allreduce", bytes=flat.nbytes, algorithm="native"):
            comm.native_allreduce(flat, "sum")
    else:
        flat = _run(comm, "allreduce", buf, algorithm)
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
