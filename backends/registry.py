"""The backends, one entry each: what the launcher needs to know to start a world of one.

    BACKENDS["local"].available()      # None, or what to install
    entry("mpi").start               # "fork", "threads" or "mpiexec": how its ranks start
    entry("torch").prepare(ctx, session, world_size, timeout)   # (connect(rank), what to keep)

Every backend is a folder of the same shape: ``setup.py`` (``available()``, and for ranks the
launcher starts itself, ``prepare()``; torch binds its rendezvous in ``rendezvous.py``) and
``comm.py`` (its Communicator). A backend's module is imported only when one of its functions is
called: listing the backends, or launching a local world, loads no MPI and no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
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
    ``shared_memory``: its buffers live in /dev/shm, and a receive reduces straight out of the
    peer's buffer (the engines' own all-reduces may add a scratch copy per rank instead).
    ``gpu``: where its ranks compute: "never" (host arrays), "always" (cuda) or "device" (on a GPU
    when ``--device`` names one: torch, whose ``--device cpu`` runs gloo). ``simulated``: its
    time is a simulated cluster's (``prepare`` takes the cluster as ``cluster=``; sim).
    """

    name: str
    available: Callable[[], str | None]
    start: str
    prepare: Callable[[BaseContext, str, int, float], tuple[Connect, Any]] | None = None
    one_host: bool = False
    tells_death: bool = False
    shared_memory: bool = False
    gpu: str = "never"
    simulated: bool = False

    @property
    def forked(self) -> bool:
        return self.start in ("fork", "threads")


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported when first called: listing the backends loads none of them."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = f"{module}.{name}"
    return call


def _setup(backend: str, name: str) -> Callable[..., Any]:
    """A function of ``dplab.backends.<backend>.setup``: every backend folder has one."""
    return _lazy(f"dplab.backends.{backend}.setup", name)


BACKENDS: dict[str, Backend] = {
    "local": Backend("local", _setup("local", "available"), "fork", _setup("local", "prepare"),
                     one_host=True, tells_death=True, shared_memory=True),
    "mpi": Backend("mpi", _setup("mpi", "available"), "mpiexec"),
    "torch": Backend("torch", _setup("torchdist", "available"), "fork",
                     # bound pre-fork
                     _lazy("dplab.backends.torchdist.rendezvous", "prepare"), gpu="device"),
    "cuda": Backend("cuda", _setup("cuda", "available"), "threads", _setup("cuda", "prepare"),
                    one_host=True, gpu="always"),
    "sim": Backend("sim", _setup("sim", "available"), "threads", _setup("sim", "prepare"),
                   one_host=True, simulated=True),
}


def entry(name: str) -> Backend:
    """The entry of ``name``, or a ConfigError listing the backends."""
    found = BACKENDS.get(name)
    if found is None:
        raise ConfigError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return found
