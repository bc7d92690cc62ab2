"""All-reduce benchmark in the style of nccl-tests, with the machine's memory copy as the ceiling.

    dplab bench --world-sizes 2 --sizes 4K,16M,64M

Each rank times a loop of ``n`` back-to-back all-reduces (``n`` sized so a loop takes about
``target_s``) and divides by ``n``; a cell's time is the mean over ranks, the median of ``reps``
repetitions with the algorithms interleaved. ``native`` is the engine's all-reduce as its users
call it (``MPI_Allreduce``, ``dist.all_reduce``, no shape check). As in nccl-tests:

    algbw = bytes / time            busbw = algbw * 2 (p - 1) / p     (0 at p = 1)

``vs_memcpy`` divides busbw by the bandwidth of one ``np.copyto`` (rank 0's ``memcpy`` row in
every run), ``vs_native`` by the engine's all-reduce of the same bytes. Buffers come from
``comm.empty``; ``staged_bytes`` counts what a rank copied into shared memory first. On GPUs the
buffers are device tensors, every clock read waits for the device (``torch.cuda.synchronize``),
the memcpy row is a device-to-device ``Tensor.copy_`` and ``native`` is NCCL's ``all_reduce``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dplab.backends.fastpath.executor import allreduce, broadcast
from dplab.reference import auto

__all__ = ["bench_rank", "memcpy_times", "summarize", "parse_size", "busbw_factor", "Device"]


def parse_size(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '1G', or a plain byte count.

    Args:
        text: a number with an optional K, M or G (KB, KiB, ... too).

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``text`` is not a number of bytes.
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def busbw_factor(p: int) -> float:
    """nccl-tests' all-reduce factor 2 (p - 1) / p: the bytes each rank's link carries per byte
    reduced. 0 at p = 1, where nothing travels.

    Args:
        p: the world size, >= 1.

    Returns:
        busbw / algbw for an all-reduce over ``p`` ranks.
    """
    return 2 * (p - 1) / p


class Device:
    """Where a bench run's buffers live and how to read a clock there: host memory (numpy, no wait),
    or a CUDA device (torch tensors; wait for the device before every clock read)."""

    def __init__(self, comm: Any) -> None:
        dev = getattr(comm, "device", None)
        self.cuda = getattr(dev, "type", "cpu") == "cuda"
        self.device = dev

    def empty(self, comm: Any, n: int, dtype: np.dtype) -> Any:
        if not self.cuda:
            return comm.empty(n, dtype)
        import torch

        return torch.zeros(n, dtype=getattr(torch, dtype.name), device=self.device)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def copy_pair(self, nbytes: int) -> tuple[Any, Any]:
        """Source and destination of the copy row: the device's own memory on a GPU."""
        if not self.cuda:
            src = np.ones(nbytes, dtype=np.uint8)
            return src, np.empty_like(src)
        import torch

        src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        return src, torch.empty_like(src)


def bench_rank(comm: Any, algorithms: list[str], sizes: list[int], dtype: str, warmup: int,
               target_s: float, max_iters: int, reps: int = 5) -> dict[str, list[dict[str, Any]]]:
    """Runs on every rank; returns this rank's loop times (per call, one per rep) for every cell.

    Args:
        comm: this rank's communicator.
        algorithms: the all-reduces to time, interleaved in every rep.
        sizes: buffer sizes in bytes.
        dtype: the buffers' element type.
        warmup: untimed calls per cell.
        target_s: timed seconds per cell, split among the reps (rank 0's estimate sets every
            rank's number of calls).
        max_iters: most calls in one loop.
        reps: timed loops per cell.

    Returns:
        ``{"allreduce": cells, "memcpy": cells}``, a cell being ``{algorithm, bytes, times,
        staged_bytes}`` (and ``ran`` for ``"auto"``); rank 0 alone times the memory copy.
    """
    dt, dev = np.dtype(dtype), Device(comm)
    out: dict[str, list[dict[str, Any]]] = {"allreduce": [], "memcpy": []}
    for nbytes in sizes:
        buf = dev.empty(comm, nbytes // dt.itemsize, dt)
        buf[:] = 0  # zeros stay zeros: no overflow however many iterations
        steps = {a: (lambda a=a, buf=buf: allreduce(comm, buf, a)) for a in algorithms}
        if "native" in steps:  # the engine's all-reduce as its users call it: no dplab shape check
            steps["native"] = lambda buf=buf: comm.native_allreduce(buf, check=False)
        iters = {a: _loop_size(comm, steps[a], warmup, target_s / reps, max_iters, dev.sync)
                 for a in algorithms}
        times = {a: np.empty(reps) for a in algorithms}
        staged = dict.fromkeys(algorithms, 0)
        for rep in range(reps):
            for a in algorithms:
                comm.barrier()
                before = getattr(comm, "bytes_staged", 0)
                times[a][rep] = _time_loop(steps[a], iters[a], dev.sync)
                staged[a] += getattr(comm, "bytes_staged", 0) - before
        for a in algorithms:
            out["allreduce"].append({"algorithm": a, "bytes": nbytes, "times": times[a],
                                     "staged_bytes": staged[a] / (reps * iters[a])})
            if a == "auto":  # the row says which algorithm auto ran for this size
                out["allreduce"][-1]["ran"] = auto.chosen(comm, buf.reshape(-1))
        if comm.rank == 0:
            out["memcpy"].append(memcpy_times(nbytes, warmup, target_s, max_iters, reps, dev))
        comm.barrier()
    return out


def _loop_size(comm: Any, step: Any, warmup: int, target_s: float, max_iters: int,
               sync: Any = lambda: None) -> int:
    """Iterations per timed loop: rank 0's estimate from one call, so that all ranks agree."""
    for _ in range(warmup):
        step()
    estimate = np.array([_time_loop(step, 1, sync)], dtype=np.float64)
    broadcast(comm, estimate)
    return int(np.clip(target_s / max(estimate[0], 1e-7), 3, max_iters))


def _time_loop(step: Any, n: int, sync: Any = lambda: None) -> float:
    """Seconds per call of ``n`` calls; ``sync`` waits for the device before each clock read."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - t0) / n


def memcpy_times(nbytes: int, warmup: int, target_s: float, max_iters: int, reps: int = 5,
                 dev: Device | None = None) -> dict[str, Any]:
    """One copy of ``nbytes``: ``np.copyto`` on one core (the ceiling of shared memory), or the
    device's own ``Tensor.copy_`` on a GPU."""
    src, dst = dev.copy_pair(nbytes) if dev is not None else Device(None).copy_pair(nbytes)
    sync = dev.sync if dev is not None else (lambda: None)
    step = ((lambda: dst.copy_(src)) if dev is not None and dev.cuda
            else (lambda: np.copyto(dst, src)))
    for _ in range(warmup + 1):
        step()
    n = int(np.clip(target_s / reps / max(_time_loop(step, 1, sync), 1e-7), 3, max_iters))
    times = np.array([_time_loop(step, n, sync) for _ in range(reps)])
    return {"algorithm": "memcpy", "bytes": nbytes, "times": times, "staged_bytes": 0}


def summarize(backend: str, world_size: int, per_rank: list[dict[str, list[dict[str, Any]]]]
              ) -> list[dict[str, Any]]:
    """Rows of one run (one backend, one world): per repetition the mean over ranks, then the
    median.

    The run's own memory-copy row comes last (``algorithm`` memcpy, this run's backend and world
    size, timed by rank 0 on one core) and is what this run's ``vs_memcpy`` divides by: runs of
    different backends or world sizes happen at different moments of a shared machine. ``vs_native``
    divides by the engine's own all-reduce of the same bytes in this run (None without one).

    Args:
        backend: the run's backend.
        world_size: the run's world size.
        per_rank: every rank's ``bench_rank`` result, in rank order.

    Returns:
        One row per (algorithm, size), then the memory-copy rows: ``{backend, algorithm,
        world_size, bytes, time_us, algbw_gbps, busbw_gbps, staged_bytes, vs_memcpy, vs_native}``.
    """
    rows = []
    cells = [[r["allreduce"][i] for r in per_rank] for i in range(len(per_rank[0]["allreduce"]))]
    for mine in cells + [[m] for m in per_rank[0]["memcpy"]]:
        first = mine[0]
        copy = first["algorithm"] == "memcpy"
        t = float(np.median(np.mean(np.stack([m["times"] for m in mine]), axis=0)))
        algbw = first["bytes"] / t / 1e9
        rows.append({
            "backend": backend, "algorithm": first["algorithm"], "world_size": world_size,
            "bytes": first["bytes"], "time_us": t * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * (1.0 if copy else busbw_factor(world_size)),
            "staged_bytes": max(m["staged_bytes"] for m in mine),
        })
        if "ran" in first:
            rows[-1]["ran"] = first["ran"]
    ceiling = {r["bytes"]: r["busbw_gbps"] for r in rows if r["algorithm"] == "memcpy"}
    native = {r["bytes"]: r["busbw_gbps"] for r in rows if r["algorithm"] == "native"}
    for r in rows:
        r["vs_memcpy"] = r["busbw_gbps"] / ceiling[r["bytes"]] if ceiling.get(r["bytes"]) else None
        mem = r["algorithm"] == "memcpy"
        r["vs_native"] = (
            r["busbw_gbps"] / native[r["bytes"]] if native.get(r["bytes"]) and not mem else None
        )
    return rows
