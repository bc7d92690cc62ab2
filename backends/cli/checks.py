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
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dplab.backends.launch.engine import LAUNCHERS, launcher_hosts, local_ranks
from dplab.backends.launch.limits import check_world
from dplab.backends.launch.world import check_backend, launcher_env, under_launcher
from dplab.reference.algorithms.layout import resolve
from dplab.reference.errors import ConfigError
from dplab.reference.files import real_target

if TYPE_CHECKING:  # bench's spec loads the cost model (for auto): imported by bench_spec, for bench
    from dplab.backends.bench.spec import BenchSpec

__all__ = ["check_args", "OutputPathError", "stop_launcher_job", "check_output_file",
           "check_output_dir", "bench_spec"]

class OutputPathError(ConfigError):
    """An output path is bad. Only the rank that writes (rank 0) checks, so under a launcher the
    other ranks do not know: see ``stop_launcher_job``."""


def stop_launcher_job(backend: str, code: int) -> None:
    """Rank 0 alone failed a check under a launcher: the other ranks may wait for it for ever
    (in MPI_Init, under mpiexec), so its launcher stops them (``Launcher.abort``)."""
    if under_launcher(backend):
        LAUNCHERS[backend].abort(code)


def check_args(a: argparse.Namespace, printer: bool = True) -> None:
    """Everything about ``a`` that can be known before any work. ``printer``: this process writes
    the outputs (under mpiexec/torchrun only rank 0 does, so only rank 0 checks the paths)."""
    backends = [a.backend] if a.command == "train" else a.backends
    if a.device == "cuda" and set(backends) == {"cuda"}:
        pass  # the cuda backend's ranks are on the GPU anyway: --device cuda only says so
    elif a.device is not None and "torch" not in backends:
        raise ConfigError(f"--device {a.device} picks the torch backend's device (cpu: gloo, "
                          f"cuda: NCCL); backend {', '.join(backends)} has no device choice: "
                          "drop --device or use --backend torch")
    if a.command == "train":
        _check_launcher_world(a)
    if a.command in ("compare", "bench"):
        _check_launcher_grid(a)
    if a.command in ("train", "compare", "bench"):
        _check_hosts(a, backends)
    # before any cell runs
    for p in (a.world_sizes or ()) if a.command in ("compare", "bench") else ():
        if p < 1:
            raise ConfigError(f"world_size must be a positive integer, got {p}")
    if a.command in ("compare", "bench") and a.world_sizes:  # the largest world, before the first
        for backend in backends:                             # cell runs (train: run_train checks)
            if not under_launcher(backend):
                check_backend(backend)
                check_world(backend, max(a.world_sizes))
    if a.command == "bench":
        bench_spec(a).check()
    if printer:
        if a.json:
            check_output_file("--json", a.json)
        if a.command == "train":
            chrome = str(Path(a.trace).with_suffix(".chrome.json")) if a.trace else None
            for option, path in (("--trace", a.trace), ("--trace", chrome),
                                 ("--save-params", a.save_params)):
                if path:
                    check_output_file(option, path)
            if a.checkpoint_dir:
                check_output_dir("--checkpoint-dir", a.checkpoint_dir)


def _check_launcher_world(a: argparse.Namespace) -> None:
    """Every rank of a launcher job sees the same mismatch: one line from
    rank 0, not a traceback each."""
    if a.world_size is not None and under_launcher(a.backend):
        started = launcher_env(a.backend)[1]
        if started != a.world_size:
            raise ConfigError(f"the launcher started {started} ranks but --world-size is "
                              f"{a.world_size}: drop --world-size or make them agree")


def _check_launcher_grid(a: argparse.Namespace) -> None:
    """Under mpiexec/torchrun the grid's world is the launcher's ranks: one size, that one."""
    for backend in a.backends:
        if under_launcher(backend):
            started = launcher_env(backend)[1]
            if a.world_sizes != [started]:
                raise ConfigError(
                    f"the launcher started {started} ranks: give "
                    f"--world-sizes {started} (not "
                    f"{','.join(map(str, a.world_sizes or ['the default 1,2,3,4']))})"
                )


def _check_hosts(a: argparse.Namespace, backends: list[str]) -> None:
    """A ``hierarchical:g`` whose g is not the launcher's ranks per host: one line from rank 0
    before any rank starts (every rank reads the same launcher's environment, so every rank
    refuses). The layout: the launcher's own (torchrun, Slurm), else consecutive blocks of this
    host's count (hydra's placement from -hosts); the communicator's
    ``hosts`` checks the real one again."""
    names = [a.algorithm] if a.command == "train" else (a.algorithms or [])
    for backend in backends:
        counts = local_ranks(backend) if under_launcher(backend) else None
        if counts is None or not names:
            continue
        local, size = counts
        hosts = launcher_hosts(size) or (tuple(r // local for r in range(size)) if local else None)
        for name in names if hosts is not None else ():
            resolve(name, hosts)


def check_output_file(option: str, path: str) -> None:
    """``path`` can be written: its directory exists and takes a new file (or the file is writable).
    A link is judged by its target (a loop of links is refused)."""
    try:
        p = real_target(path, option)
    except ConfigError as e:
        raise OutputPathError(str(e)) from None
    if p.is_dir():
        raise OutputPathError(f"{option} {path} is a directory: give a file name")
    parent = p.parent
    if not parent.is_dir():
        raise OutputPathError(f"{option} {path}: directory {parent} does not exist: create "
                              "it first")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{option} {path} is not writable: choose another path")
        return
    _probe(option, path, parent)


def check_output_dir(option: str, path: str) -> None:
    """``path`` is a writable directory, or one that can be made in an existing writable parent.
    A link must lead to a directory: a loop, or a link to nowhere, cannot become one."""
    p = Path(path)
    if p.is_symlink() and not p.exists():  # exists() follows the link: a loop or a missing target
        raise OutputPathError(f"{option} {path} is a symbolic link that leads to no directory "
                              "(a loop of links, or a missing target): remove it or choose "
                              "another path")
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


def bench_spec(a: argparse.Namespace) -> BenchSpec:
    """``dplab bench``'s options as the ``BenchSpec`` the app builds too."""
    from dplab.backends.bench.spec import BenchSpec

    return BenchSpec(tuple(a.backends), tuple(a.world_sizes), tuple(a.sizes), tuple(a.algorithms),
                     a.dtype, a.warmup, a.target_seconds, a.reps, a.max_iters,
                     getattr(a, "cluster", None), getattr(a, "worlds", 1))
