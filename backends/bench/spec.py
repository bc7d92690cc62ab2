"""What a bench measures, checked before any rank starts, and the run itself.

``BenchSpec`` holds ``dplab bench``'s options (its defaults are the command's); ``check`` refuses
in one line what cannot run (an unknown algorithm, a size below one element, more memory or
/dev/shm than the machine has); ``run`` starts one world per world size and returns the rows.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.backends.bench.timing import bench_rank, summarize
from dplab.backends.launch.limits import mem_available_bytes  # within this process's cgroup too
from dplab.backends.launch.world import check_backend
from dplab.backends.registry import entry
from dplab.backends.sim.setup import resolve_cluster
from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.errors import ConfigError

__all__ = ["BenchSpec", "MemoryNeed", "bench_memory_need", "shm_free_bytes", "mem_available_bytes",
           "pooled"]

SHM = "/dev/shm"
# (world size, backend) -> a world to run on
World = Callable[[int, str], AbstractContextManager[Any]]


@dataclass(frozen=True)
class BenchSpec:
    """One ``dplab bench``: every backend x world size is one run with its own memcpy row.

    Attributes:
        backends: the backends to measure.
        world_sizes: the world sizes to measure, each a world of its own.
        sizes: the all-reduce's sizes in bytes.
        algorithms: the all-reduces to time (schedules' names and ``"native"``).
        dtype: the buffers' element type.
        warmup: untimed calls per cell before timing.
        target_seconds: timed work per cell.
        reps: timed loops per cell, algorithms interleaved.
        max_iters: most calls in one timed loop.
        cluster: backend ``"sim"``: the simulated cluster (timing-only runs, any p).
        worlds: worlds started one after another for each backend x world size, every cell the
            median over all their reps: where ranks outnumber cores, one world's times can differ
            twofold from the next one's (the OS places its ranks once; the machine's other work).
    """

    backends: tuple[str, ...] = ("local",)
    world_sizes: tuple[int, ...] = (2,)
    sizes: tuple[int, ...] = (4096, 1 << 20, 16 << 20, 64 << 20)  # bytes
    algorithms: tuple[str, ...] = ("ring", "tree", "naive", "native")
    dtype: str = "float32"
    warmup: int = 3  # untimed calls per cell before timing
    target_seconds: float = 0.3  # timed work per cell
    reps: int = 5  # timed loops per cell, algorithms interleaved
    max_iters: int = 2000  # most calls in one timed loop
    cluster: str | None = None  # backend "sim": the simulated cluster (timing-only runs, any p)
    worlds: int = 1  # worlds per backend x world size, one after another, their reps pooled

    def check(self) -> None:
        """ConfigError, in one line, for anything that cannot run here.

        Raises:
            ConfigError: bad counts or sizes, an unknown algorithm or backend, buffers that do not
                fit /dev/shm or memory, a world larger than the simulated cluster, or ``cluster``
                without the sim backend.
            BackendUnavailable: a backend's engine is not installed.
        """
        if self.reps < 1 or self.target_seconds <= 0 or self.warmup < 0 or self.worlds < 1:
            raise ConfigError("bench needs --reps >= 1, --worlds >= 1, --target-seconds > 0 and "
                              "--warmup >= 0")
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ConfigError("world sizes must be positive integers, got "
                              f"{list(self.world_sizes)}")
        if not self.sizes:
            raise ConfigError("bench needs at least one size")
        for backend in self.backends:
            check_backend(backend)
        unknown = [alg for alg in self.algorithms if not has_schedule(alg)]
        if unknown:
            raise ConfigError(f"unknown algorithm {unknown[0]!r}: choose from "
                              f"{', '.join(ALGORITHMS)}")
        itemsize = np.dtype(self.dtype).itemsize
        small = [s for s in self.sizes if s < itemsize]
        if small:
            raise ConfigError(f"size {small[0]} bytes is less than one {self.dtype} element "
                              f"({itemsize} bytes): use --sizes of at least {itemsize}")
        for backend in self.backends:
            if entry(backend).simulated:  # timing-only: sizes, no bytes; the cluster must hold them
                resolve_cluster(self.cluster).check_world(max(self.world_sizes))
                continue
            need = bench_memory_need(backend, max(self.world_sizes), list(self.sizes))
            check_room(need, shm_free_bytes() if need.shm else 0, mem_available_bytes())
        if self.cluster is not None and not any(entry(b).simulated for b in self.backends):
            raise ConfigError("--cluster names a simulated cluster: add --backends sim, or drop "
                              "--cluster")

    def run(self, world: World, backend: str, world_size: int) -> list[dict[str, Any]]:
        """The rows of one backend x world size, on a world from ``world(world_size, backend)``; on
        a simulated cluster, from the schedules alone (``dplab.backends.sim.timing``: any p).

        Args:
            world: ``world(world_size, backend)`` gives a context manager with ``run`` (``World``).
            backend: the backend's name.
            world_size: ranks.

        Returns:
            nccl-tests-style rows (``summarize``), the memory-copy row last.
        """
        if entry(backend).simulated:
            from dplab.backends.sim.timing import bench_rows

            return bench_rows(resolve_cluster(self.cluster), world_size, list(self.algorithms),
                              list(self.sizes), self.dtype)
        runs = []
        for _ in range(self.worlds):
            with world(world_size, backend) as w:
                runs.append(w.run(bench_rank, list(self.algorithms), list(self.sizes), self.dtype,
                                  self.warmup, self.target_seconds, self.max_iters, self.reps))
        return summarize(backend, world_size, pooled(runs))


def pooled(runs: list[list[dict[str, list[dict[str, Any]]]]]) -> list[dict[str, list[dict]]]:
    """Several worlds' ``bench_rank`` results as one world's: each rank's cells with the reps of
    every world, one after another (a cell's staged bytes, the most of any world)."""
    def cells(mine: list[dict[str, Any]]) -> dict[str, Any]:
        return mine[0] | {"times": np.concatenate([c["times"] for c in mine]),
                          "staged_bytes": max(c["staged_bytes"] for c in mine)}

    return [{kind: [cells(list(c)) for c in zip(*(run[r][kind] for run in runs))]
             for kind in ("allreduce", "memcpy")} for r in range(len(runs[0]))]


@dataclass(frozen=True)
class MemoryNeed:
    """Peak bytes a bench run of one backend holds: in /dev/shm (local backend) and in RAM.

    Attributes:
        backend: the backend's name.
        world_size: ranks.
        per_rank: buffer bytes one rank holds at its peak.
        shm: of which in /dev/shm, all ranks together.
        ram: all ranks together, /dev/shm included (tmpfs lives in RAM), plus rank 0's memcpy.
    """

    backend: str
    world_size: int
    per_rank: int  # buffer bytes one rank holds at its peak
    shm: int  # of which in /dev/shm, all ranks together
    ram: int  # all ranks together, /dev/shm included (tmpfs lives in RAM), plus rank 0's memcpy


def bench_memory_need(backend: str, world_size: int, sizes: list[int]) -> MemoryNeed:
    """What ``bench_rank`` allocates: each rank holds the buffer being timed and, while the next
    size is allocated, the previous one; rank 0's memory-copy row adds a source and a destination
    of the largest size. The engines' own all-reduces (MPI, gloo) may add a scratch copy of the
    buffer per rank; the local backend reduces straight out of the peers' shared memory.

    Args:
        backend: the backend's name.
        world_size: ranks.
        sizes: the all-reduce's sizes in bytes, in the order timed.

    Returns:
        The peak bytes, in /dev/shm and in RAM.
    """
    pairs = [a + b for a, b in zip(sizes, [0, *sizes[:-1]])]
    largest = max(sizes)
    in_shm = entry(backend).shared_memory
    per_rank = max(pairs) + (0 if in_shm else largest)
    shm = world_size * max(pairs) if in_shm else 0
    return MemoryNeed(backend, world_size, per_rank, shm, world_size * per_rank + 2 * largest)


def check_room(need: MemoryNeed, shm_free: int, ram_free: int | None) -> None:
    """ConfigError when ``need`` does not fit in /dev/shm or in the memory available."""
    what = (f"bench --backend {need.backend} at world size {need.world_size} holds up to "
            f"{_gib(need.per_rank)} per rank")
    if need.shm > shm_free:
        raise ConfigError(f"{what}: {_gib(need.shm)} of {SHM} in all, but {_gib(shm_free)} "
                          "is free: use smaller --sizes or fewer ranks (or enlarge /dev/shm)")
    if ram_free is not None and need.ram > ram_free:
        raise ConfigError(f"{what}: {_gib(need.ram)} of memory in all, but {_gib(ram_free)} "
                          "is available (MemAvailable): use smaller --sizes or fewer ranks")


def shm_free_bytes() -> int:
    try:
        return shutil.disk_usage(SHM).free
    except OSError:  # no /dev/shm here: the local backend will say so itself
        return 1 << 62


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
