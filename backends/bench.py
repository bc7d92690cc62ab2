"""All-reduce benchmark in the style of nccl-tests, with the machine's memory copy as the ceiling.

    dplab bench --world-sizes 2 --sizes 4K,16M,64M

For every (algorithm, size) all ranks run ``warmup`` all-reduces, then ``iters``
timed ones back to back; each iteration's time is the slowest rank's, and the row
reports the median (robust on a shared machine). As in nccl-tests:

    algbw = bytes / time            busbw = algbw * 2 (p - 1) / p

busbw is what each rank's link carried, so it is comparable across world sizes
and with the memory-copy bandwidth (bytes / time of one ``np.copyto``), measured
by rank 0 in the same run: the ceiling for any shared-memory transport.

Buffers come from ``comm.empty`` (shared memory on the local backend: the ring
then makes no copy beyond the algorithm's own reduce and copy of each chunk);
``staged_bytes`` counts the bytes a rank had to copy into shared memory first.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from reference.collectives import allreduce, broadcast

__all__ = ["bench_rank", "memcpy_times", "summarize", "parse_size", "busbw_factor"]


def parse_size(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '1G', or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def busbw_factor(p: int) -> float:
    return 2 * (p - 1) / p if p > 1 else 1.0


def _time_iters(fn: Any, iters: int) -> np.ndarray:
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return times


def bench_rank(comm: Any, algorithms: list[str], sizes: list[int], dtype: str, warmup: int,
               target_s: float, max_iters: int) -> dict[str, list[dict[str, Any]]]:
    """Runs on every rank; returns this rank's per-iteration times for every (algorithm, size)."""
    dt = np.dtype(dtype)
    out: dict[str, list[dict[str, Any]]] = {"allreduce": [], "memcpy": []}
    for nbytes in sizes:
        buf = comm.empty(nbytes // dt.itemsize, dt)
        for algorithm in algorithms:
            buf[:] = 0  # zeros stay zeros: no overflow however many iterations

            def step(buf: np.ndarray = buf, algorithm: str = algorithm) -> None:
                allreduce(comm, buf, algorithm)

            for _ in range(warmup):
                step()
            iters = np.array([_time_iters(step, 1)[0]], dtype=np.float64)
            broadcast(comm, iters)  # rank 0's estimate sizes the run: all ranks must agree
            n = int(np.clip(target_s / max(iters[0], 1e-7), 3, max_iters))
            staged0 = getattr(comm, "bytes_staged", 0)
            comm.barrier()
            times = _time_iters(step, n)
            out["allreduce"].append({"algorithm": algorithm, "bytes": buf.nbytes, "times": times,
                        "staged_bytes": (getattr(comm, "bytes_staged", 0) - staged0) / n})
        if comm.rank == 0:
            out["memcpy"].append(memcpy_times(buf.nbytes, warmup, target_s, max_iters))
        comm.barrier()
    return out


def memcpy_times(nbytes: int, warmup: int, target_s: float, max_iters: int) -> dict[str, Any]:
    """One core copying ``nbytes`` with ``np.copyto``: the bandwidth ceiling of shared memory."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)

    def step() -> None:
        np.copyto(dst, src)

    for _ in range(warmup + 1):
        step()
    n = int(np.clip(target_s / max(_time_iters(step, 1)[0], 1e-7), 3, max_iters))
    return {"algorithm": "memcpy", "bytes": nbytes, "times": _time_iters(step, n), "staged_bytes": 0}


def summarize(backend: str, world_size: int, per_rank: list[dict[str, list[dict[str, Any]]]]
              ) -> list[dict[str, Any]]:
    """Rows from every rank's timings: per iteration the slowest rank, then the median."""
    rows = []
    cells = [[r["allreduce"][i] for r in per_rank] for i in range(len(per_rank[0]["allreduce"]))]
    for mine in cells + [[m] for m in per_rank[0]["memcpy"]]:
        first = mine[0]
        copy = first["algorithm"] == "memcpy"
        t = float(np.median(np.max(np.stack([m["times"] for m in mine]), axis=0)))
        algbw = first["bytes"] / t / 1e9
        p = 1 if copy else world_size
        rows.append({
            "backend": "memcpy" if copy else backend, "algorithm": first["algorithm"], "world_size": p,
            "bytes": first["bytes"], "time_us": t * 1e6, "algbw_gbps": algbw,
            "busbw_gbps": algbw * (1.0 if copy else busbw_factor(p)),
            "staged_bytes": max(m["staged_bytes"] for m in mine),
        })
    ceiling = {r["bytes"]: r["busbw_gbps"] for r in rows if r["algorithm"] == "memcpy"}
    for r in rows:
        r["vs_memcpy"] = r["busbw_gbps"] / ceiling[r["bytes"]] if r["bytes"] in ceiling else float("nan")
    return rows
