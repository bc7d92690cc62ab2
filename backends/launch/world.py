"""Start a world of ranks and run a function on every one of them.

    from dplab.backends.launch.world import launch
    def hello(comm):                       # runs on every rank
        return comm.rank
    launch(hello, world_size=4)            # -> [0, 1, 2, 3]; backend="mpi" or "torch" too

``launch`` returns the per-rank results, or raises one ``RankError`` naming the
first rank that failed, with its traceback. The other ranks are then killed and
every shared-memory segment of the world is unlinked, also when a rank was killed
by a signal. A persistent ``World`` keeps its ranks alive between calls, so tests
can run hundreds of examples without paying process start-up each time:

    with World(4, backend="local") as world:
        world.run(fn, *args)               # fn must be a module-level function (it is pickled)

How ranks start: local and torch ranks are forked (milliseconds; torch ranks then
rendezvous on loopback); MPI ranks are started by the ``mpiexec`` of the installed
MPI (the ``mpich`` wheel) and connect back to the launcher over loopback. Under an
engine's own launcher (``mpiexec -n 4 dplab train --backend mpi``, ``torchrun``)
``launch`` runs ``fn`` on the launcher's ranks instead and returns everyone's results.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import wait
from typing import Any

from dplab.backends.launch.engine import launcher_env, run_here, under_launcher
from dplab.backends.launch.serve import die_with_parent, serve
from dplab.backends.local.shm import PREFIX, sweep_stale, unlink_prefix
from dplab.backends.mpi.mpiexec import kill_group, start_mpiexec, sweep_mpich_shm
from dplab.reference.errors import ConfigError, DplabError

__all__ = ["launch", "World", "RankError", "RankLost", "BackendUnavailable", "BACKENDS", "check_backend",
           "default_timeout", "under_launcher", "launcher_env"]

BACKENDS = ("local", "mpi", "torch")


class RankError(DplabError):
    """A rank raised or died; ``rank`` says which, the message carries its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


@dataclass(frozen=True)
class RankLost:
    """The result of a tolerated rank that died (``launch(..., tolerate={ranks})``): how it died."""

    rank: int
    detail: str


class BackendUnavailable(DplabError):
    """The backend asked for is not installed on this machine."""


def default_timeout() -> float:
    return float(os.environ.get("DPLAB_TIMEOUT", "60"))


def check_backend(backend: str) -> None:
    """ConfigError for an unknown backend, BackendUnavailable (saying what to install) for a missing one."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "mpi":
        from dplab.backends.mpi.comm import available
    elif backend == "torch":
        from dplab.backends.torchdist.setup import available
    else:
        return
    reason = available()
    if reason:
        raise BackendUnavailable(f"backend {backend!r} is not available: {reason}")


class World:
    """``world_size`` ranks of one backend, kept alive between ``run`` calls."""

    def __init__(self, world_size: int, backend: str = "local", timeout: float | None = None,
                 job: tuple[Callable, tuple] | None = None, tolerate: frozenset[int] = frozenset()) -> None:
        """``tolerate``: ranks whose death (not an exception) gives a ``RankLost``, not a failure."""
        check_backend(backend)
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        if under_launcher(backend):
            raise ConfigError(f"this process is already one rank of a {backend} launcher job: "
                              "call launch(), which runs on the launcher's ranks")
        self.world_size, self.backend, self.tolerate = world_size, backend, frozenset(tolerate)
        self.timeout = timeout if timeout is not None else default_timeout()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._mpiexec: subprocess.Popen | None = None
        self._start(job)

    # -- starting -----------------------------------------------------------------------------
    def _start(self, job: tuple[Callable, tuple] | None) -> None:
        sweep_stale()
        self.session = f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        if self.backend == "mpi":
            self._start_mpiexec(job)
        else:
            self._start_forked(job)

    def _start_forked(self, job: tuple[Callable, tuple] | None) -> None:
        ctx = mp.get_context("fork")
        if self.backend == "local":
            from dplab.backends.local.comm import LocalComm, Wiring

            # Kept for the world's lifetime: its pid array lives in multiprocessing's shared heap,
            # and a block freed here would be handed to the next world while ours still use it.
            self._wiring = Wiring.create(ctx, self.session, self.world_size, self.timeout)
            connect = partial(LocalComm, self._wiring)
        else:
            from dplab.backends.torchdist.rendezvous import prepare

            connect = prepare(self.world_size, self.timeout)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_forked_rank, args=(partial(connect, rank), child, job),
                               daemon=True, name=f"dplab-{self.backend}-rank-{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _start_mpiexec(self, job: tuple[Callable, tuple] | None) -> None:
        self._mpiexec, self._conns = start_mpiexec(self.world_size, self.timeout)
        if job is not None:
            for conn in self._conns:
                conn.send(job)

    # -- running ------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(comm, *args)`` on every rank; per-rank results in rank order."""
        if not self._conns:
            self._start(None)
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect()

    def _collect(self) -> list[Any]:
        """Every rank's result, or one RankError naming the rank that caused the failure.

        When one rank fails the others often fail right after it (a lost peer, or mpiexec
        terminating the job), so failures are gathered for a moment and the cause is
        reported: a rank that died first, then one that raised, then one that was stopped.
        """
        results: dict[int, Any] = {}
        failed: dict[int, tuple[str, str]] = {}
        waiting = {c: r for r, c in enumerate(self._conns)} | {
            p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = None
        while len(results) + len(failed) < self.world_size:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready_list = wait(list(waiting), timeout=left)
            if deadline is not None and (not ready_list or time.monotonic() >= deadline):
                break
            for ready in ready_list:
                rank = waiting.get(ready)
                if rank is None or rank in results or rank in failed:
                    continue
                if ready is self._conns[rank]:
                    try:
                        status, value = ready.recv()
                    except (EOFError, OSError):
                        status, value = "died", self._death_note(rank)
                elif self._conns[rank].poll():
                    continue  # its result is waiting in the pipe; read it on the next pass
                else:
                    status, value = "died", self._death_note(rank)
                if status == "died" and rank in self.tolerate and self.backend == "local":
                    status, value = "ok", RankLost(rank, value)  # else: fatal
                if status == "error" and "PeerLost: " in value.rstrip().rsplit("\n", 1)[-1]:
                    status = "lost"  # a consequence: it lost a peer that failed first; report that one
                if status == "ok":
                    results[rank] = value
                else:
                    failed[rank] = (status, value)
                    grace = 3.0 if status in ("stopped", "lost") else 0.5
                    deadline = min(deadline or float("inf"), time.monotonic() + grace)
                waiting = {k: r for k, r in waiting.items() if r != rank}  # a dead rank stays ready
        if failed:
            self.abort()
            order = list(failed)  # arrival order breaks ties: the first to die is the cause
            rank = min(order, key=lambda r: (["died", "error", "lost", "stopped"].index(failed[r][0]),
                                             order.index(r)))
            raise RankError(rank, failed[rank][1])
        return [results[r] for r in range(self.world_size)]

    def _death_note(self, rank: int) -> str:
        if self._mpiexec is not None:
            return "the MPI rank's connection closed: the process died (no Python traceback)"
        proc = self._procs[rank]
        proc.join(1)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"process died from signal {signal.Signals(-code).name} (no Python traceback)"
        return f"process exited with code {code} before returning a result"

    # -- stopping -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Kill every rank now and unlink the world's shared memory."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        if self._mpiexec is not None:
            kill_group(self._mpiexec)
            sweep_mpich_shm(min_age_s=0.0)  # what the killed ranks could not clean up
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._mpiexec = [], [], None
        unlink_prefix(self.session)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5)
        if self._mpiexec is not None:
            try:
                self._mpiexec.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.abort()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int | None = None, backend: str = "local",
           args: tuple = (), timeout: float | None = None,
           tolerate: frozenset[int] = frozenset()) -> list[Any]:
    """Run ``fn(comm, *args)`` on every rank; returns the per-rank results in rank order.

    Fresh ranks are started unless this process already is a rank of an engine
    launcher's job, in which case ``fn`` runs here and results are gathered from all.
    Local and torch ranks are forked, so ``fn`` may be any callable; MPI ranks are new
    interpreters, so there ``fn`` must be a module-level function. A rank of ``tolerate``
    that dies (SIGKILL, exit) gives a ``RankLost`` result instead of failing the world; what
    the others make of it is ``fn``'s business (the parameter server: ``dplab.reference.ps.server``).
    Only on the local backend: on mpi (MPI's failure model) and torch (gloo cannot tell a dead
    peer from a slow one) a tolerated rank's death still fails the world, naming that rank.
    """
    check_backend(backend)
    if under_launcher(backend):
        return run_here(fn, world_size, backend, tuple(args), timeout or default_timeout())
    if world_size is None:
        raise ConfigError("world_size is required outside mpiexec/torchrun")
    world = World(world_size, backend, timeout, job=(fn, tuple(args)), tolerate=tolerate)
    try:
        return world._collect()
    finally:
        world.close()


def _forked_rank(connect: Callable[[], Any], conn: Any, job: tuple[Callable, tuple] | None) -> None:
    die_with_parent()
    serve(connect, conn, job)
