"""Run any schedule over any Communicator, in place: the executor.

    from dplab.reference.collectives import allreduce
    allreduce(comm, grads, algorithm="ring", op="mean")   # every rank, same buffer shape

Round by round it hands this rank's sends and receives (added into the buffer or copied over
it) to ``comm.exchange``; a round's consecutive chunks to one peer go as one message
(``messages_of``), and a chunk sent and received into in one round is sent as the round found
it. ``comm.check_buffer`` first, so a mismatched buffer or call raises ``BufferMismatch`` or
``CollectiveMismatch``, not a hang. Dtypes: float16/32/64, int32/64 (torch.bfloat16 on torch);
partial sums are rounded to the buffer's dtype, as NCCL does, so ranks agree bit for bit but two
algorithms may not. ``algorithm="auto"`` is refused: resolve it first
(``dplab.reference.auto.chosen(comm, buf)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
           "schedule_of", "schedule_plan", "flat_view", "is_float", "DTYPES", "TORCH_DTYPES"]

DTYPES = ("float16", "float32", "float64", "int32", "int64")  # numpy arrays, on every backend
TORCH_DTYPES = (*DTYPES, "bfloat16")  # torch tensors, on the torch backend


def run_schedule(comm: Communicator, buf: Any, schedule: Schedule) -> None:
    """Execute ``schedule`` on this rank's ``buf`` (1-D, contiguous array or tensor), round by
    round.

    Args:
        comm: this rank's communicator.
        buf: the flat buffer, reduced or copied in place.
        schedule: the schedule every rank runs.

    Raises:
        CommTimeout: a peer did not take part in a round in time.
        BufferMismatch: ranks passed buffers of different lengths or dtypes.
        CollectiveMismatch: ranks ran different collectives.
    """
    bounds = chunk_bounds(len(buf), schedule.num_chunks)

    def part(m: Message) -> Any:  # the message's chunks m.chunk .. m.stop - 1: one slice of buf
        return buf[bounds[m.chunk][0]:bounds[m.stop - 1][1]]

    for k, (sends, recvs) in enumerate(messages_of(schedule, comm.rank)):
        if not sends and not recvs:
            continue  # this rank sits the round out
        out = [SendSpec(_copy(part(m)) if m.snapshot else part(m), m.dst, m.chunk) for m in sends]
        into = [RecvSpec(part(m), m.src, m.chunk, m.op == "reduce") for m in recvs]
        comm.exchange(out, into, round=k, algorithm=schedule.name)


def _copy(x: Any) -> Any:
    """A copy of a numpy array or torch tensor (reference imports no torch)."""
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def schedule_of(kind: str, algorithm: str, p: int, root: int = 0) -> Schedule:
    """The schedule of collective ``kind`` run by ``algorithm`` on ``p`` ranks (``root``: rooted
    kinds).

    Args:
        kind: "allreduce", "reduce_scatter", "allgather", "broadcast" or "reduce".
        algorithm: a registered algorithm that has that kind.
        p: the number of ranks.
        root: the root of a broadcast or reduce.

    Returns:
        The schedule.

    Raises:
        ConfigError: the algorithm has no schedule of that kind, or a bad parameter.
    """
    # the registry, on use
    from dplab.reference.algorithms import ROOTED, SCATTER, allreduce_schedule, lookup

    if kind == "allreduce":
        return allreduce_schedule(algorithm, p)
    if kind in ("reduce_scatter", "allgather"):
        pair, extra = lookup(SCATTER, algorithm, kind)
        return pair[kind == "allgather"](p, *extra)
    pair, extra = lookup(ROOTED, algorithm, kind)
    return pair[kind == "broadcast"](p, root, *extra)


def schedule_plan(kind: str, algorithm: str, p: int, rank: int, root: int = 0
                  ) -> tuple[Schedule, list[tuple[list[Message], list[Message]]]]:
    """The schedule of a collective and this rank's part of it: (sends, receives) per round.

    Args:
        kind: the collective, as ``schedule_of``.
        algorithm: the algorithm, as ``schedule_of``.
        p: the number of ranks.
        rank: this rank.
        root: the root of a broadcast or reduce.

    Returns:
        (schedule, plan): the plan is ``messages_of(schedule, rank)``.

    Raises:
        ConfigError: as ``schedule_of``.
    """
    schedule = schedule_of(kind, algorithm, p, root)
    return schedule, messages_of(schedule, rank)


def flat_view(buf: Any, comm: Communicator | None = None) -> Any:
    """A 1-D view of ``buf``, a numpy array or torch tensor the collectives can work on in place
    (over ``comm``, when given: a tensor needs one that ``moves_tensors``); a ``ConfigError`` saying
    what to pass instead otherwise (on every rank, before any message).

    Args:
        buf: the caller's buffer.
        comm: the communicator it will travel over, if known.

    Returns:
        ``buf`` as a 1-D view sharing its memory.

    Raises:
        ConfigError: a read-only array, an unsupported dtype, a non-contiguous buffer, a tensor on
            a transport of numpy arrays, or neither an array nor a tensor.
    """
    if isinstance(buf, np.ndarray):
        require_writable(buf)
        if buf.dtype.name not in DTYPES:
            raise ConfigError(f"dtype {buf.dtype} not supported: use {', '.join(DTYPES)} (numpy "
                              "has no bfloat16: pass a torch.bfloat16 tensor on the torch backend)")
        if not buf.flags.c_contiguous:
            raise ConfigError("collectives work in place on contiguous arrays: use "
                              "np.ascontiguousarray")
        return buf.reshape(-1)
    if type(buf).__module__.startswith("torch"):
        if str(buf.dtype).removeprefix("torch.") not in TORCH_DTYPES:
            raise ConfigError(f"dtype {buf.dtype} not supported: use {', '.join(TORCH_DTYPES)}")
        if comm is not None and not comm.moves_tensors:
            raise ConfigError(f"torch tensors travel on the torch backend; the {comm.backend} "
                              "backend moves numpy arrays: pass t.numpy() (a CPU tensor shares its "
                              "memory) or use backend='torch' (bfloat16 only there: numpy has no "
                              "bfloat16)")
        if not buf.is_contiguous():
            raise ConfigError(
                "collectives work in place on contiguous tensors: pass t.contiguous()"
            )
        return buf.view(-1)
    raise ConfigError(f"collectives take numpy arrays (or torch tensors), got {type(buf).__name__}")


def is_float(buf: Any) -> bool:
    """Does ``buf`` (numpy array or torch tensor) hold floating-point numbers?

    Args:
        buf: a numpy array or torch tensor.

    Returns:
        True for a floating-point dtype.
    """
    dtype = buf.dtype
    return dtype.kind == "f" if isinstance(dtype, np.dtype) else bool(dtype.is_floating_point)


def _run(comm: Communicator, kind: str, buf: Any, algorithm: str, root: int | None = None) -> Any:
    """Check ``buf``, announce the call to the backend and run its schedule;
    returns the flat view."""
    flat = flat_view(buf, comm)
    if root is not None and not 0 <= root < comm.world_size:
        raise ConfigError(f"root {root} is not a rank of a world of size {comm.world_size}")
    schedule = schedule_of(kind, algorithm, comm.world_size, root or 0)
    with comm.tracer.span(kind, bytes=flat.nbytes, algorithm=algorithm):
        comm.check_buffer(flat, Collective(kind, algorithm, -1 if root is None else root))
        run_schedule(comm, flat, schedule)
    return flat


def allreduce(
    comm: Communicator, buf: np.ndarray, algorithm: str = "ring", op: str = "sum"
) -> np.ndarray:
    """Sum (or average, ``op="mean"``) ``buf`` across all ranks, in place; returns ``buf``.
    ``algorithm="native"`` runs the engine's own all-reduce. "auto" is the caller's to resolve first
    (``dplab.reference.auto.chosen``): the executor runs schedules, it does not price them.

    Args:
        comm: this rank's communicator.
        buf: a contiguous array (or tensor), the same length and dtype on every rank.
        algorithm: a registered all-reduce (``ALGORITHMS``), or "native".
        op: "sum" or "mean".

    Returns:
        ``buf``, which now holds the sum (or mean) on every rank.

    Raises:
        ConfigError: a bad op, buffer or algorithm; "auto" (resolve it first), "mean" on integers.
        CollectiveMismatch: ranks called different collectives or algorithms.
        BufferMismatch: ranks passed different lengths or dtypes.
        CommTimeout: a peer did not take part in time.
    """
    if op not in ("sum", "mean"):
        raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
    flat = flat_view(buf, comm)
    if op == "mean" and not is_float(buf):
        raise ConfigError(f"op='mean' needs a floating-point buffer, got {buf.dtype}: use op='sum'")
    if algorithm == "auto":
        raise ConfigError("algorithm 'auto' is chosen before the executor runs: pass "
                          "dplab.reference.auto.chosen(comm, buf), or call "
                          "dplab.backends.allreduce, which resolves it")
    if algorithm == "native":
        with comm.tracer.span("allreduce", bytes=flat.nbytes, algorithm="native"):
            comm.native_allreduce(flat, "sum")
    else:
        _run(comm, "allreduce", buf, algorithm)
    if op == "mean" and comm.world_size > 1:
        flat /= comm.world_size
    return buf


def reduce_scatter(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """Afterwards this rank's chunk (``chunk_bounds(n, p)[rank]``) holds the sum;
    returns a view of it.

    Args:
        comm: this rank's communicator.
        buf: a contiguous array (or tensor), the same length and dtype on every rank; scratch after.
        algorithm: one of ``SCATTER_ALGORITHMS``.

    Returns:
        A view of this rank's chunk of ``buf``.

    Raises:
        ConfigError: a bad buffer, or an algorithm with no reduce-scatter.
        CollectiveMismatch: ranks called different collectives or algorithms.
        BufferMismatch: ranks passed different lengths or dtypes.
        CommTimeout: a peer did not take part in time.
    """
    flat = _run(comm, "reduce_scatter", buf, algorithm)
    return flat[slice(*chunk_bounds(len(flat), comm.world_size)[comm.rank])]


def allgather(comm: Communicator, buf: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """Every rank contributes its own chunk of ``buf``; afterwards all hold all chunks.

    Args:
        comm: this rank's communicator.
        buf: a contiguous array (or tensor) holding this rank's chunk in place.
        algorithm: one of ``SCATTER_ALGORITHMS``.

    Returns:
        ``buf``, every chunk filled in.

    Raises:
        ConfigError: a bad buffer, or an algorithm with no all-gather.
        CollectiveMismatch: ranks called different collectives or algorithms.
        BufferMismatch: ranks passed different lengths or dtypes.
        CommTimeout: a peer did not take part in time.
    """
    _run(comm, "allgather", buf, algorithm)
    return buf


def broadcast(
    comm: Communicator, buf: np.ndarray, root: int = 0, algorithm: str = "tree"
) -> np.ndarray:
    """Afterwards every rank holds ``root``'s ``buf``.

    Args:
        comm: this rank's communicator.
        buf: a contiguous array (or tensor), the same length and dtype on every rank.
        root: the rank whose buffer is sent.
        algorithm: "tree" or "naive".

    Returns:
        ``buf``.

    Raises:
        ConfigError: a bad buffer, root or algorithm.
        CollectiveMismatch: ranks called different collectives, algorithms or roots.
        BufferMismatch: ranks passed different lengths or dtypes.
        CommTimeout: a peer did not take part in time.
    """
    _run(comm, "broadcast", buf, algorithm, root)
    return buf


def reduce(
    comm: Communicator, buf: np.ndarray, root: int = 0, algorithm: str = "tree"
) -> np.ndarray:
    """Afterwards ``root`` holds the sum; other ranks' buffers hold partial sums (scratch).

    Args:
        comm: this rank's communicator.
        buf: a contiguous array (or tensor), the same length and dtype on every rank.
        root: the rank that ends with the sum.
        algorithm: "tree" or "naive".

    Returns:
        ``buf``.

    Raises:
        ConfigError: a bad buffer, root or algorithm.
        CollectiveMismatch: ranks called different collectives, algorithms or roots.
        BufferMismatch: ranks passed different lengths or dtypes.
        CommTimeout: a peer did not take part in time.
    """
    _run(comm, "reduce", buf, algorithm, root)
    return buf
