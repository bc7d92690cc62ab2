"""Start a world of ranks and run a function on every one of them.

    from dplab.backends.launch.world import launch
    def hello(comm):                       # runs on every rank
        return comm.rank
    launch(hello, world_size=4)            # -> [0, 1, 2, 3]; backend="mpi" or "torch" too

    with World(4, backend="local") as world:   # ranks kept alive between calls
        world.run(fn, *args)               # fn must be a module-level function (it is pickled)

``launch`` returns the per-rank results, or raises one ``RankError`` naming the first rank that
failed; the other ranks are then killed and the world's shared memory unlinked. Nothing outlives
the launcher: an unclosed ``World`` ends at garbage collection or interpreter exit, Ctrl-C kills
the ranks before KeyboardInterrupt comes out, and ranks of a killed launcher end themselves
(``watch``). How each backend starts its ranks: ``dplab.backends.registry``; a function of the
user's ``__main__`` reaches MPI ranks through ``mainmod``. Under ``mpiexec`` or ``torchrun``,
``launch`` runs ``fn`` on the engine's ranks and returns everyone's results.
"""

from __future__ import annotations

import importlib
import os
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from dplab.backends.launch import mainmod
from dplab.backends.launch.engine import (
    LauncherWorld,
    launcher_env,
    run_here,
    spans_hosts,
    under_launcher,
)
from dplab.backends.launch.interrupt import signals_deferred
from dplab.backends.launch.ranks import Ranks, pickle_job, start_ranks
from dplab.backends.launch.serve import in_rank
from dplab.backends.launch.timeouts import check_timeout, default_timeout
from dplab.backends.local.shm import PREFIX, sweep_stale
from dplab.backends.registry import BACKENDS as _REGISTRY
from dplab.backends.registry import entry
from dplab.reference.errors import ConfigError, DplabError

__all__ = ["launch", "World", "open_world", "RankError", "RankLost", "BackendUnavailable",
           "BACKENDS", "check_backend", "default_timeout", "under_launcher", "launcher_env"]

BACKENDS = tuple(_REGISTRY)  # the registry's names (dplab.backends.registry)
_STOP = ("died", "error", "lost", "stopped")  # which failure names the cause, first to last
_UNKNOWN = "the rank's connection closed: the process died (no Python traceback)"


def _death_note(ranks: Ranks, which: list[int]) -> dict[int, str]:
    """How each rank of ``which`` died; a rank whose end nobody
    recorded gets ``_UNKNOWN`` itself."""
    return {r: note or _UNKNOWN for r, note in ranks.death_notes(which).items()}


class RankError(DplabError):
    """A rank raised or died; ``rank`` says which, the message carries its traceback.

    Args:
        rank: the rank that failed.
        detail: its traceback, or how it died (a signal, an exit code).
    """

    def __init__(self, rank: int, detail: str) -> None:
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")

    def config_error(self) -> str | None:
        """The message, when the rank failed with a ``ConfigError`` (a one-line error about the
        input or the machine, e.g. a full /dev/shm); None for a bug or a crash, whose traceback
        matters.

        Returns:
            The ``ConfigError``'s message (the last line of the traceback, without its class), or
            None.
        """
        last = self.detail.rstrip().rsplit("\n", 1)[-1]
        name, sep, message = last.partition(": ")
        module, _, cls = name.rpartition(".")
        if not sep or not module.startswith("dplab."):
            return None
        try:
            found = getattr(importlib.import_module(module), cls, None)
        except ImportError:
            return None
        return message if isinstance(found, type) and issubclass(found, ConfigError) else None


@dataclass(frozen=True)
class RankLost:
    """The result of a tolerated rank that died (``launch(..., tolerate={ranks})``): how it died.

    Attributes:
        rank: the rank that died.
        detail: how it died (the signal or exit code).
    """

    rank: int
    detail: str


class BackendUnavailable(DplabError):
    """The backend asked for is not installed on this machine."""


def check_backend(backend: str) -> None:
    """ConfigError for an unknown backend, BackendUnavailable (saying what to install) for a missing
    one.

    Args:
        backend: a backend's name (``dplab.backends.registry``).

    Raises:
        ConfigError: no backend has that name.
        BackendUnavailable: the backend's engine is not installed here; the message says what to
            install.
    """
    reason = entry(backend).available()
    if reason:
        raise BackendUnavailable(f"backend {backend!r} is not available: {reason}")


class World:
    """``world_size`` ranks of one backend, kept alive between ``run`` calls."""

    def __init__(self, world_size: int, backend: str = "local", timeout: float | None = None,
                 job: tuple[Callable, tuple] | None = None, tolerate: frozenset[int] = frozenset(),
                 cluster: Any = None) -> None:
        """Start the ranks (checked first: nothing starts if the world cannot work).

        Args:
            world_size: how many ranks, >= 1.
            backend: ``"local"``, ``"mpi"``, ``"torch"``, ``"cuda"`` or ``"sim"``.
            timeout: seconds any blocking wait of the world may take (default ``DPLAB_TIMEOUT``).
            job: ``(fn, args)`` to run on every rank as soon as they exist, collected by
                ``launch``; None starts idle ranks.
            tolerate: ranks whose death (not an exception) gives a ``RankLost``, not a failure.
            cluster: the simulated cluster of backend "sim" (a preset's name, a file, a Cluster).

        Raises:
            ConfigError: an unknown backend, a bad ``world_size`` or ``timeout``, ``cluster`` on
                a backend that is not simulated, a one-host backend across hosts, a world started
                while an MPI script is imported, from inside a rank, or from a rank of an engine
                launcher's job.
            BackendUnavailable: the backend's engine is not installed.
            WorldTooLarge: this machine cannot hold the world (processes, memory, /dev/shm, maps,
                files); the message says by how much.
        """
        check_backend(backend)
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        self.timeout = check_timeout(timeout) if timeout is not None else default_timeout()
        if under_launcher(backend):
            raise ConfigError(f"this process is already one rank of a {backend} launcher job: "
                              "call launch(), which runs on the launcher's ranks")
        found = entry(backend)
        if cluster is not None and not found.simulated:
            raise ConfigError(f"cluster= names a simulated cluster: use backend='sim', not "
                              f"{backend!r}")
        if found.one_host and (why := spans_hosts()):  # shared memory reaches one host's ranks only
            raise ConfigError(f"the {backend} backend runs on one host, but {why}: "
                              "use --backend torch or mpi")
        if mainmod.booting():
            raise ConfigError('this script starts a dplab world when it is imported, so every '
                              'MPI rank that loads it would start one too: put the launch under '
                              'if __name__ == "__main__":')
        if in_rank():
            raise ConfigError("launch() was called inside a rank of a running world, which cannot "
                              "start ranks of its own: use the comm your function was given (its "
                              "collectives run on this world's ranks), or launch from the script "
                              "that started the world")
        if not found.forked and job is not None:  # new interpreters must import the job
            mainmod.check_sendable(job[0])
        from dplab.backends.launch.limits import check_world  # (not in the short import)

        check_world(backend, world_size)  # processes, memory, maps, descriptors: refused up front
        self.world_size, self.backend, self.tolerate = world_size, backend, frozenset(tolerate)
        self.cluster = cluster
        self._entry = found
        self._ranks: Ranks | None = None
        self._finalizer: weakref.finalize | None = None
        self._start(job)

    def _start(self, job: tuple[Callable, tuple] | None) -> None:
        sweep_stale()
        self.session = f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        ranks = start_ranks(self.backend, self.world_size, self.session, self.timeout, job,
                            self.cluster)
        # An unclosed world ends with its last reference or with the interpreter, never later.
        self._ranks, self._finalizer = ranks, weakref.finalize(self, ranks.kill)

    # -- running ------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(comm, *args)`` on every rank; per-rank results in rank order.

        Args:
            fn: called on every rank with its communicator; pickled (on mpi, it must be importable
                from a module or the script being run).
            *args: passed to ``fn`` after ``comm``; pickled.

        Returns:
            ``fn``'s result on each rank, in rank order (a ``RankLost`` for a tolerated rank that
            died).

        Raises:
            RankError: a rank raised or died (the others are killed; the next run starts them
                afresh).
            ConfigError: on mpi, ``fn`` cannot reach fresh interpreters (defined in ``python -c``
                or a notebook).
        """
        if not self._entry.forked:
            mainmod.check_sendable(fn)
        payload = pickle_job(fn, args)
        try:
            if self._ranks is None:
                self._start(None)
            self._ranks.send_all(payload)
            return self._collect()
        except BaseException:
            self.abort()  # Ctrl-C included: the ranks are mid-job, the world starts afresh next run
            raise

    def _collect(self) -> list[Any]:
        """Every rank's result, or one RankError naming the rank that caused the failure.

        When one rank fails the others often fail right after it (a lost peer, or mpiexec
        terminating the job), so failures are gathered for a moment and the cause is
        reported: a rank that died first, then one that raised, then one that lost a peer,
        then one that was stopped; among ranks that died, one whose end was recorded.
        """
        ranks = self._ranks
        results: dict[int, Any] = {}
        failed: dict[int, tuple[str, str | None]] = {}
        waiting = ranks.sentinels()
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
                if ready is ranks.conns[rank]:
                    try:
                        status, value = ready.recv()
                    except (EOFError, OSError):
                        status, value = "died", None
                elif ranks.conns[rank].poll():
                    continue  # its result is waiting in the pipe; read it on the next pass
                else:
                    status, value = "died", None
                if status == "died" and rank in self.tolerate and self._entry.tells_death:
                    # else: fatal
                    status, value = "ok", RankLost(rank, _death_note(ranks, [rank])[rank])
                if status == "error" and "PeerLost: " in value.rstrip().rsplit("\n", 1)[-1]:
                    # a consequence: it lost a peer that failed first; report that one
                    status = "lost"
                if status == "ok":
                    results[rank] = value
                else:
                    failed[rank] = (status, value)
                    grace = 3.0 if status in ("stopped", "lost") else 0.5
                    deadline = min(deadline or float("inf"), time.monotonic() + grace)
                waiting = {k: r for k, r in waiting.items() if r != rank}  # a dead rank stays ready
        if failed:
            died = _death_note(ranks, [r for r, (status, _) in failed.items() if status == "died"])
            failed |= {r: ("died", note) for r, note in died.items()}
            order = list(failed)  # arrival order breaks ties: the first to die is the cause
            rank = min(order, key=lambda r: (_STOP.index(failed[r][0]), failed[r][1] is _UNKNOWN,
                                             order.index(r)))
            self.abort()
            raise RankError(rank, failed[rank][1])
        return [results[r] for r in range(self.world_size)]

    # -- stopping -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Kill every rank now and unlink the world's shared memory; a signal meanwhile waits."""
        with signals_deferred():
            if self._finalizer is not None:
                self._finalizer()  # ranks.kill(), once
            self._ranks = self._finalizer = None

    def close(self) -> None:
        """Ask the ranks to finish (5 s in all), then make sure: nothing of the world is left."""
        with signals_deferred():
            if self._ranks is not None:
                self._ranks.stop(5.0)
            self.abort()

    def __enter__(self) -> World:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            # an error or Ctrl-C in the block: the ranks' state is unknown, end them now
            self.abort()


def open_world(world_size: int, backend: str = "local", timeout: float | None = None,
               cluster: Any = None) -> World | LauncherWorld:
    """A ``World`` of fresh ranks; under ``backend``'s own launcher (mpiexec, torchrun), its ranks.

    Args:
        world_size: how many ranks (under a launcher, checked against the launcher's).
        backend: the backend's name.
        timeout: seconds any blocking wait may take (default ``DPLAB_TIMEOUT``).
        cluster: the simulated cluster of backend "sim".

    Returns:
        A ``World``, or a ``LauncherWorld`` over the launcher's ranks; both have ``run``.
    """
    if under_launcher(backend):
        return LauncherWorld(backend,
                             check_timeout(timeout) if timeout is not None else default_timeout(),
                             world_size)
    return World(world_size, backend, timeout, cluster=cluster)


def launch(fn: Callable[..., Any], world_size: int | None = None, backend: str = "local",
           args: tuple = (), timeout: float | None = None,
           tolerate: frozenset[int] = frozenset(), cluster: Any = None) -> list[Any]:
    """Run ``fn(comm, *args)`` on every rank; returns the per-rank results in rank order.

    Fresh ranks are started unless this process already is a rank of an engine
    launcher's job, in which case ``fn`` runs here and results are gathered from all.
    Local and torch ranks are forked, so ``fn`` may be any callable; MPI ranks are new
    interpreters, so there ``fn`` must be defined in a module or in the script being run
    (not in ``python -c`` or a notebook). A rank of ``tolerate``
    that dies (SIGKILL, exit) gives a ``RankLost`` result instead of failing the world; what
    the others make of it is ``fn``'s business (the parameter server:
    ``dplab.reference.ps.server``). Only on the local backend: on mpi (MPI's failure model) and
    torch (gloo cannot tell a dead peer from a slow one) a tolerated rank's death still fails the
    world, naming that rank. ``backend="sim"`` runs the ranks on a simulated ``cluster``
    (``dplab.backends.sim``).

    Args:
        fn: called as ``fn(comm, *args)`` on every rank.
        world_size: how many ranks; None under mpiexec or torchrun (the launcher's).
        backend: ``"local"`` (default), ``"mpi"``, ``"torch"``, ``"cuda"`` or ``"sim"``.
        args: passed to ``fn`` after ``comm``.
        timeout: seconds any blocking wait may take (default ``DPLAB_TIMEOUT``).
        tolerate: ranks whose death gives a ``RankLost`` result (local backend only).
        cluster: the simulated cluster of backend "sim" (a preset's name, a file, a Cluster).

    Returns:
        ``fn``'s result on each rank, in rank order.

    Raises:
        RankError: a rank raised or died, naming it with its traceback; the other ranks are
            stopped and the world's shared memory unlinked.
        ConfigError: bad arguments, or a world that cannot start here (see ``World``).
        BackendUnavailable: the backend's engine is not installed.
        WorldTooLarge: this machine cannot hold the world.
    """
    check_backend(backend)
    if under_launcher(backend):
        return run_here(fn, world_size, backend, tuple(args),
                        check_timeout(timeout) if timeout is not None else default_timeout())
    if world_size is None:
        raise ConfigError("world_size is required outside mpiexec/torchrun")
    world = World(world_size, backend, timeout, job=(fn, tuple(args)), tolerate=tolerate,
                  cluster=cluster)
    try:
        results = world._collect()
    except BaseException:
        world.abort()  # Ctrl-C or a failed rank: no waiting for ranks that are mid-job
        raise
    world.close()
    return results
