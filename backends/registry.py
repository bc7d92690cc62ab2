"""The backends, one entry each: what the launcher needs to know to start a world of one.

    BACKENDS["local"].available()      # None, or what to install
    entry("mpi").start               # "fork" or "mpiexec": how its ranks start
    entry("torch").prepare(ctx, session, world_size, timeout)   # (connect(rank), what to keep)

A backend's module is imported only when one of its functions is called: listing the
backends, or launching a local world, loads no MPI and no torch.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError

__all__ = ["Backend", "BACKENDS", "entry"]

Connect = Callable[[int], Communicator]


@dataclass(frozen=True)
class Backend:
    """One transport, as the launcher sees it.

    ``start``: "fork" (ranks are forked from the launcher and take any callable), "threads" (one
    forked process holds every rank as a thread) or "mpiexec" (ranks are new interpreters: a job
    must be importable there). ``prepare``, for forked
    ranks, runs in the launcher before the fork and returns (connect(rank), an object to keep
    alive while the ranks run). ``one_host``: its ranks must share a machine. ``tells_death``:
    a rank can tell a dead peer from a slow one, so ``launch(tolerate=...)`` can go on without it.
    """

    name: str
    available: Callable[[], str | None]
    start: str
    prepare: Callable[[BaseContext, str, int, float], tuple[Connect, Any]] | None = None
    one_host: bool = False
    tells_death: bool = False

    @property
    def forked(self) -> bool:
        return self.start in ("fork", "threads")


def _always() -> None:
    return None


def _mpi_available() -> str | None:
    from dplab.backends.mpi.comm import available

    return available()


def _torch_available() -> str | None:
    from dplab.backends.torchdist.setup import available

    return available()


def _local_prepare(ctx: BaseContext, session: str, world_size: int, timeout: float) -> tuple[Connect, Any]:
    """The semaphores and control segment the ranks share; kept for the world's lifetime: its pid
    array lives in multiprocessing's shared heap, and a block freed early would be handed to the
    next world while ours still use it."""
    from dplab.backends.local.comm import LocalComm, Wiring
    from dplab.backends.local.shm import shm_full, unlink_prefix

    try:
        wiring = Wiring.create(ctx, session, world_size, timeout)
    except OSError as e:  # the semaphores and the heap live in /dev/shm too
        unlink_prefix(session)
        if e.errno != errno.ENOSPC:
            raise
        raise shm_full(4096 * (2 * world_size + 1) * world_size, "the ranks' semaphores") from None
    return partial(LocalComm, wiring), wiring


def _cuda_available() -> str | None:
    from dplab.backends.cuda.setup import available

    return available()


def _cuda_prepare(ctx: BaseContext, session: str, world_size: int, timeout: float) -> tuple[Connect, Any]:
    from dplab.backends.cuda.setup import prepare

    return prepare(ctx, session, world_size, timeout)


def _torch_prepare(ctx: BaseContext, session: str, world_size: int, timeout: float) -> tuple[Connect, Any]:
    """The loopback rendezvous, bound in the launcher before it forks."""
    from dplab.backends.torchdist.rendezvous import prepare

    return prepare(world_size, timeout), None


BACKENDS: dict[str, Backend] = {
    "local": Backend("local", _always, "fork", _local_prepare, one_host=True, tells_death=True),
    "mpi": Backend("mpi", _mpi_available, "mpiexec"),
    "torch": Backend("torch", _torch_available, "fork", _torch_prepare),
    "cuda": Backend("cuda", _cuda_available, "threads", _cuda_prepare, one_host=True),
}


def entry(name: str) -> Backend:
    """The entry of ``name``, or a ConfigError listing the backends."""
    found = BACKENDS.get(name)
    if found is None:
        raise ConfigError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return found
