"""Running under an engine's own launcher: ``mpiexec -n 4 dplab ...`` or ``torchrun ...``.

There the ranks already exist: this process is one of them. ``launch`` then runs the
function here, on the launcher's communicator, and gathers every rank's result (a
control-path pickle; data never goes that way). A rank that raises prints its
traceback and aborts the job, so its peers fail fast instead of waiting for a timeout.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["under_launcher", "launcher_env", "run_here"]


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


def run_here(fn: Callable, world_size: int | None, backend: str, args: tuple,
             timeout: float) -> list[Any]:
    """Run ``fn(comm, *args)`` on this launcher rank; every rank gets everyone's results."""
    if backend == "mpi":
        from dplab.backends.mpi.comm import MpiComm as Comm
    else:
        from dplab.backends.torchdist.comm import TorchComm as Comm
    comm = Comm.from_launcher(timeout)
    try:
        if world_size is not None and world_size != comm.world_size:
            raise ConfigError(f"the launcher started {comm.world_size} ranks but world_size is "
                              f"{world_size}: drop --world-size or make them agree")
        result = fn(comm, *args)
    except BaseException:
        print(f"rank {comm.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        getattr(comm, "abort", comm.close)()  # MPI_Abort / close: the peers fail fast, no hang
        raise
    try:
        return comm.allgather_object(result)
    finally:
        comm.close()
