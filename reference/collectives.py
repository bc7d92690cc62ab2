"""Run any schedule over any Communicator, in place.

    from dplab.reference.collectives import allreduce
    allreduce(comm, grads, algorithm="ring", op="mean")   # every rank, same buffer shape

The executor knows nothing about rings or trees: it looks up the schedule, cuts the
flat buffer into the schedule's chunks, and for each round hands this rank's sends
and receives to ``comm.exchange``. A rank whose buffer differs from its peers' gets a
``BufferMismatch``, not a hang: every message is checked against the buffer it lands in
(empty chunks, n < p, still travel as zero-length messages), or, where the transport
cannot do that cheaply (gloo), ``comm.check_buffer`` compares the whole buffer once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from dplab.reference.algorithms import allreduce_schedule, direct, naive, ring, tree
from dplab.reference.communicator import Communicator, RecvSpec, SendSpec
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, Transfer, chunk_bounds

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "run_schedule",
           "early_receives"]

_DTYPES = (np.float32, np.float64, np.int32, np.int64)
_ROOTED = {"tree": (tree.reduce, tree.broadcast), "naive": (naive.reduce, naive.broadcast)}
_SCATTER = {"ring": (ring.reduce_scatter, ring.allgather),
            "direct": (direct.reduce_scatter, direct.allgather)}

Plan = list[tuple[list[Transfer], list[Transfer]]]


def run_schedule(comm: Communicator, buf: Any, schedule: Schedule, plan: Plan | None = None,
                 early: list[list[int]] | None = None) -> None:
    """Execute ``schedule`` on this rank's ``buf`` (1-D, contiguous array or tensor), round by round.

    Each round also hands over the next round's receives that may be posted early (``ahead``).
    A rendezvous transport (gloo) moves a message only once its receive is posted: posted a
    round early, the neighbour's send goes at once instead of waiting for a round trip."""
    plan = plan if plan is not None else schedule.transfers_of(comm.rank)
    early = early if early is not None else early_receives(plan)
    bounds = chunk_bounds(len(buf), schedule.num_chunks)
    sends = [[SendSpec(buf[slice(*bounds[t.chunk])], t.dst, t.chunk) for t in ts] for ts, _ in plan]
    recvs = [[RecvSpec(buf[slice(*bounds[t.chunk])], t.src, t.chunk, t.op == "reduce") for t in ts]
             for _, ts in plan]
    for k in range(len(plan)):
        if sends[k] or recvs[k]:
            ahead = [recvs[k + 1][i] for i in early[k]]
            comm.exchange(sends[k], recvs[k], round=k, algorithm=schedule.name, ahead=ahead)


def early_receives(plan: Plan) -> list[list[int]]:
    """For each round k, which of round k+1's receives round k cannot disturb, so that they may
    be posted during round k: those that land in scratch (reduce) and those into a chunk round
    k neither sends nor receives. A peer's receives go ahead all or none, so that messages
    between two ranks are still posted in the order they are sent."""
    early = []
    for (sends, recvs), (_, later) in zip(plan, plan[1:]):
        busy = {t.chunk for t in sends} | {t.chunk for t in recvs}
        held = {t.src for t in later if t.op != "reduce" and t.chunk in busy}
        early.append([i for i, t in enumerate(later) if t.src not in held])
    return early + [[]] if plan else []  # the last round has no next one


@lru_cache(maxsize=1024)
def _plan(kind: str, algorithm: str, p: int, rank: int, root: int = 0
          ) -> tuple[Schedule, Plan, list[list[int]]]:
    if kind == "allreduce":
        s = allreduce_schedule(algorithm, p)
    elif kind in ("reduce_scatter", "allgather"):
        s = _pick(_SCATTER, algorithm)[kind == "allgather"](p)
    else:
        s = _pick(_ROOTED, algorithm)[kind == "broadcast"](p, root)
    plan = s.transfers_of(rank)
    return s, plan, early_receives(plan)


def _pick(table: dict, algorithm: str):
    if algorithm not in table:
        raise ConfigError(f"algorithm {algorithm!r} not available here: choose one of {', '.join(table)}")
    return table[algorithm]


def _flat(buf: Any) -> Any:
    """A 1-D view of ``buf``: a numpy array, or a torch tensor (duck-typed: reference imports no torch)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype.type not in _DTYPES:
            raise ConfigError(f"dtype {buf.dtype} not supported: use float32, float64, int32 or int64")
        if not buf.flags.c_contiguous:
            raise ConfigError("collectives work in place on contiguous arrays: use np.ascontiguousarray")
        return buf.reshape(-1)
    if type(buf).__module__.startswith("torch"):
        if str(buf.dtype).removeprefix("torch.") not in ("float32", "float64", "int32", "int64"):
            raise ConfigError(f"dtype {buf.dtype} not supported: use float32, float64, int32 or int64")
        if not buf.is_contiguous():
            raise ConfigError("collectives work in place on contiguous tensors: pass t.contiguous()")
        return buf.view(-1)
    raise ConfigError(f"collectives take numpy arrays (or torch tensors), got {type(buf).__name__}")


def _is_float(buf: Any) -> bool:
    return buf.dtype.is_floating_point if hasattr(buf.dtype, "is_floating_point") else bool(
        np.issubdtype(buf.dtype, np.floating))


def _run(comm: Communicator, kind: str, buf: np.ndarray, algorithm: str, root: int = 0) -> np.ndarray:
    flat = _flat(buf)
    if not 0 <= root < comm.world_size:
        raise ConfigError(f"root {root} is not a rank of a world of size {comm.world_size}")
    schedule, plan, early = _plan(kind, algorithm, comm.world_size, comm.rank, root)
    with comm.tracer.span(kind, bytes=flat.nbytes, algorithm=algorithm):
        comm.check_buffer(flat)
        run_schedule(comm, flat, schedule, plan, early)
    return flat


def allreduce(comm: Communicator, buf: np.ndarray, algorithm: str = "ring", op: str = "sum") -> np.ndarray:
    """Sum (or average, ``op="mean"``) ``buf`` across all ranks, in place; returns ``buf``."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    _flat(buf)
    if op == "mean" and not _is_float(buf):
        raise ConfigError(f"op='mean' needs a floating-point buffer, got {buf.dtype}: use op='sum'")
    if algorithm == "native":
        flat = _flat(buf)
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
