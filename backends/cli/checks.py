"""Checks that run before any rank starts, so a bad argument costs a second, not the run.

    dplab train --json /no/such/dir/rows.json   # error: --json ...: directory ... does not exist
    dplab bench --sizes 64G                     # error: ... 128.0 GiB of /dev/shm in all, but ...

Each check raises ``ConfigError`` with what to do; ``commands.main`` prints it as one line
and exits 2. Output files are probed by creating (and removing) a file beside them: that is
the only test that holds for root, read-only mounts and /proc alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dplab.backends.launch.world import check_backend, launcher_env, under_launcher
from dplab.reference.algorithms import ALGORITHMS, has_schedule
from dplab.reference.errors import ConfigError

__all__ = ["check_args", "OutputPathError", "stop_launcher_job", "check_output_file", "check_output_dir",
           "bench_memory_need", "MemoryNeed", "shm_free_bytes", "mem_available_bytes"]

SHM = "/dev/shm"


class OutputPathError(ConfigError):
    """An output path is bad. Only the rank that writes (rank 0) checks, so under a launcher the
    other ranks do not know: see ``stop_launcher_job``."""


def stop_launcher_job(backend: str, code: int) -> None:
    """Rank 0 alone failed a check under ``mpiexec``: the other ranks would wait for it in MPI_Init
    for ever, so abort the job (torchrun stops the other ranks itself once one exits). MPICH's own
    "Abort(2) on node 0" line goes to /dev/null: ours was printed already."""
    if backend == "mpi" and under_launcher("mpi"):
        from mpi4py import MPI

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        MPI.COMM_WORLD.Abort(code)


def check_args(a: argparse.Namespace, printer: bool = True) -> None:
    """Everything about ``a`` that can be known before any work. ``printer``: this process writes
    the outputs (under mpiexec/torchrun only rank 0 does, so only rank 0 checks the paths)."""
    backends = [a.backend] if a.command == "train" else a.backends
    if a.device is not None and "torch" not in backends:
        raise ConfigError(f"--device {a.device} picks the torch backend's device (cpu: gloo, cuda: NCCL); "
                          f"backend {', '.join(backends)} has no device choice: drop --device or use "
                          "--backend torch")
    if a.command == "train":
        _check_launcher_world(a)
    if a.command in ("compare", "bench"):
        _check_launcher_grid(a)
    for p in (a.world_sizes or ()) if a.command in ("compare", "bench") else ():  # before any cell runs
        if p < 1:
            raise ConfigError(f"world_size must be a positive integer, got {p}")
    if a.command == "bench":
        _check_bench(a)
    if printer:
        if a.json:
            check_output_file("--json", a.json)
        if a.command == "train":
            for option, path in (("--trace", a.trace), ("--save-params", a.save_params)):
                if path:
                    check_output_file(option, path)
            if a.checkpoint_dir:
                check_output_dir("--checkpoint-dir", a.checkpoint_dir)


def _check_launcher_world(a: argparse.Namespace) -> None:
    """Every rank of a launcher job sees the same mismatch: one line from rank 0, not a traceback each."""
    if a.world_size is not None and under_launcher(a.backend):
        started = launcher_env(a.backend)[1]
        if started != a.world_size:
            raise ConfigError(f"the launcher started {started} ranks but --world-size is {a.world_size}: "
                              "drop --world-size or make them agree")


def _check_launcher_grid(a: argparse.Namespace) -> None:
    """Under mpiexec/torchrun the grid's world is the launcher's ranks: one size, that one."""
    for backend in a.backends:
        if under_launcher(backend):
            started = launcher_env(backend)[1]
            if a.world_sizes != [started]:
                raise ConfigError(f"the launcher started {started} ranks: give --world-sizes {started} "
                                  f"(not {','.join(map(str, a.world_sizes or ['the default 1,2,3,4']))})")


def check_output_file(option: str, path: str) -> None:
    """``path`` can be written: its directory exists and takes a new file (or the file is writable)."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{option} {path} is a directory: give a file name")
    parent = p.parent
    if not parent.is_dir():
        raise OutputPathError(f"{option} {path}: directory {parent} does not exist: create it first")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {path} is not writable: choose another path")
        return
    _probe(option, path, parent)


def check_output_dir(option: str, path: str) -> None:
    """``path`` is a writable directory, or one that can be made in an existing writable parent."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{option} {path} is a file, not a directory: choose another path")
    where = p if p.is_dir() else p.parent
    if not where.is_dir():
        raise OutputPathError(f"{option} {path}: directory {where} does not exist: create it first")
    _probe(option, path, where)


def _probe(option: str, path: str, directory: Path) -> None:
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".dplab-probe-")
    except OSError as e:
        raise OutputPathError(f"{option} {path}: cannot write in {directory} ({e.strerror}): "
                          "choose a writable place") from None
    os.close(fd)
    os.unlink(name)


def _check_bench(a: argparse.Namespace) -> None:
    if a.reps < 1 or a.target_seconds <= 0 or a.warmup < 0:
        raise ConfigError("bench needs --reps >= 1, --target-seconds > 0 and --warmup >= 0")
    for backend in a.backends:
        check_backend(backend)
    unknown = [alg for alg in a.algorithms if not has_schedule(alg)]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}: choose from {', '.join(ALGORITHMS)}")
    itemsize = np.dtype(a.dtype).itemsize
    small = [s for s in a.sizes if s < itemsize]
    if small:
        raise ConfigError(f"size {small[0]} bytes is less than one {a.dtype} element ({itemsize} bytes): "
                          f"use --sizes of at least {itemsize}")
    for backend in a.backends:
        need = bench_memory_need(backend, max(a.world_sizes), a.sizes)
        _check_room(need, shm_free_bytes() if need.shm else 0, mem_available_bytes())


@dataclass(frozen=True)
class MemoryNeed:
    """Peak bytes a bench run of one backend holds: in /dev/shm (local backend) and in RAM."""

    backend: str
    world_size: int
    per_rank: int  # buffer bytes one rank holds at its peak
    shm: int  # of which in /dev/shm, all ranks together
    ram: int  # all ranks together, /dev/shm included (tmpfs lives in RAM), plus rank 0's memcpy


def bench_memory_need(backend: str, world_size: int, sizes: list[int]) -> MemoryNeed:
    """What ``bench_rank`` allocates: each rank holds the buffer being timed and, while the next
    size is allocated, the previous one; rank 0's memory-copy row adds a source and a destination
    of the largest size. The engines' own all-reduces (MPI, gloo) may add a scratch copy of the
    buffer per rank; the local backend reduces straight out of the peers' shared memory."""
    pairs = [a + b for a, b in zip(sizes, [0, *sizes[:-1]])]
    largest = max(sizes)
    per_rank = max(pairs) + (0 if backend == "local" else largest)
    shm = world_size * max(pairs) if backend == "local" else 0
    return MemoryNeed(backend, world_size, per_rank, shm, world_size * per_rank + 2 * largest)


def _check_room(need: MemoryNeed, shm_free: int, ram_free: int | None) -> None:
    what = (f"bench --backend {need.backend} at world size {need.world_size} holds up to "
            f"{_gib(need.per_rank)} per rank")
    if need.shm > shm_free:
        raise ConfigError(f"{what}: {_gib(need.shm)} of {SHM} in all, but {_gib(shm_free)} is free: "
                          "use smaller --sizes or fewer ranks (or enlarge /dev/shm)")
    if ram_free is not None and need.ram > ram_free:
        raise ConfigError(f"{what}: {_gib(need.ram)} of memory in all, but {_gib(ram_free)} is available "
                          "(MemAvailable): use smaller --sizes or fewer ranks")


def shm_free_bytes() -> int:
    try:
        return shutil.disk_usage(SHM).free
    except OSError:  # no /dev/shm here: the local backend will say so itself
        return 1 << 62


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where there is none to read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
