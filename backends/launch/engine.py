"""Running under an engine's own launcher: ``mpiexec -n 4 dplab ...`` or ``torchrun ...``.

There the ranks already exist: this process is one of them. ``launch`` then runs the
function here, on the launcher's communicator, and gathers every rank's result (a
control-path pickle; data never goes that way). A rank that raises prints its
traceback and aborts the job, so its peers fail fast instead of waiting for a timeout.
``LauncherWorld`` keeps that communicator for several runs (``dplab compare`` and ``bench``, via
``world.open_world``). The local backend's shared memory reaches one host only: ``spans_hosts``
reads from the launcher's environment whether its job has ranks on other hosts.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["under_launcher", "launcher_env", "launcher_rank", "spans_hosts", "LauncherWorld", "run_here"]


def under_launcher(backend: str) -> bool:
    """True when this process is one rank of an ``mpiexec`` (mpi) or ``torchrun`` (torch) job."""
    env = os.environ
    if backend == "mpi":
        return "DPLAB_AUTHKEY" not in env and any(
            k in env for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    if backend == "torch":
        return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    return False


def launcher_env(backend: str) -> tuple[int, int]:
    """(rank, world_size) that mpiexec or torchrun gave this process."""
    env = os.environ
    keys = {"mpi": [("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")],
            "torch": [("RANK", "WORLD_SIZE")]}.get(backend, [])
    for rank, size in keys:
        if rank in env and size in env:
            return int(env[rank]), int(env[size])
    raise ConfigError(f"not running under a {backend} launcher")


def launcher_rank() -> int | None:
    """This process's rank in the job of whichever engine launcher started it, None outside one."""
    for backend in ("mpi", "torch"):
        if under_launcher(backend):
            return launcher_env(backend)[0]
    return None


def spans_hosts() -> str | None:
    """Why this process is one rank of a launcher job across several hosts (its launcher's own
    count of the ranks on this host), or None: one host, or no launcher."""
    env = os.environ
    for launcher, size, local in (("torchrun", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
                                  ("mpiexec", "PMI_SIZE", "MPI_LOCALNRANKS"),  # MPICH's hydra
                                  ("mpiexec", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        if env.get(size, "").isdigit() and env.get(local, "").isdigit() and int(env[local]) < int(env[size]):
            return f"this {launcher} job has {env[size]} ranks, {env[local]} of them on this host"
    return None


class LauncherWorld:
    """The launcher's ranks as a world: ``run(fn, *args)`` runs ``fn(comm, *args)`` here, on one
    communicator kept for the world's life, and returns every rank's result (as ``World.run``)."""

    def __init__(self, backend: str, timeout: float, world_size: int | None = None) -> None:
        if backend == "mpi":
            from dplab.backends.mpi.comm import MpiComm as Comm
        else:
            from dplab.backends.torchdist.comm import TorchComm as Comm
        self.backend, self.comm = backend, Comm.from_launcher(timeout)
        self.world_size = self.comm.world_size
        if world_size is not None and world_size != self.world_size:
            self._failed(ConfigError(f"the launcher started {self.world_size} ranks but world_size is "
                                     f"{world_size}: drop --world-size or make them agree"))

    def _failed(self, error: BaseException | None = None) -> None:
        """Say why on stderr and abort the job, so the peers fail fast instead of waiting."""
        detail = traceback.format_exc() if error is None else f"{type(error).__name__}: {error}\n"
        print(f"rank {self.comm.rank} failed:\n{detail}", file=sys.stderr, flush=True)
        getattr(self.comm, "abort", self.comm.close)()  # MPI_Abort / close: the peers fail fast, no hang
        if error is not None:
            raise error

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        try:
            result = fn(self.comm, *args)
        except BaseException:
            self._failed()
            raise
        return self.comm.allgather_object(result)

    def close(self) -> None:
        self.comm.close()

    def __enter__(self) -> LauncherWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_here(fn: Callable, world_size: int | None, backend: str, args: tuple,
             timeout: float) -> list[Any]:
    """Run ``fn(comm, *args)`` on this launcher rank; every rank gets everyone's results."""
    with LauncherWorld(backend, timeout, world_size) as world:
        return world.run(fn, *args)
