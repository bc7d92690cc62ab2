"""Start a world of ranks and run a function on every one of them.

    from backends.launch import launch
    def hello(comm):                       # runs on every rank
        return comm.rank
    launch(hello, world_size=4)            # -> [0, 1, 2, 3]

``launch`` returns the per-rank results, or raises one ``RankError`` naming the
first rank that failed, with its traceback. The other ranks are then killed and
every shared-memory segment of the world is unlinked, also when a rank was killed
by a signal. A persistent ``World`` keeps its ranks alive between calls, so tests
can run hundreds of examples without paying process start-up each time:

    with World(4) as world:
        world.run(fn, *args)               # fn must be a module-level function (it is pickled)

Ranks are forked (about 1 ms each); they ignore Ctrl-C, which the launcher handles.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import secrets
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from backends.local import LocalComm, Wiring
from backends.shm import PREFIX, sweep_stale, unlink_prefix
from reference.errors import ConfigError, DplabError

__all__ = ["launch", "World", "RankError", "BackendUnavailable", "BACKENDS", "default_timeout"]

BACKENDS = ("local", "mpi", "torch")


class RankError(DplabError):
    """A rank raised or died; ``rank`` says which, the message carries its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


class BackendUnavailable(DplabError):
    """The backend asked for is not installed or not built yet."""


def default_timeout() -> float:
    return float(os.environ.get("DPLAB_TIMEOUT", "60"))


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend != "local":
        raise BackendUnavailable(
            f"backend {backend!r} is not available yet in this version of dplab: use --backend local")


class World:
    """``world_size`` forked ranks of the local backend, kept alive between ``run`` calls."""

    def __init__(self, world_size: int, backend: str = "local", timeout: float | None = None,
                 job: tuple[Callable, tuple] | None = None) -> None:
        check_backend(backend)
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.world_size = world_size
        self.timeout = timeout if timeout is not None else default_timeout()
        self._procs: list[Any] = []
        self._start(job)

    def _start(self, job: tuple[Callable, tuple] | None) -> None:
        sweep_stale()
        ctx = mp.get_context("fork")
        self.session = f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        wiring = Wiring.create(ctx, self.session, self.world_size, self.timeout)
        self._conns, self._procs = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(wiring, rank, child, job), daemon=True,
                               name=f"dplab-rank-{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._pending_job = job is not None

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(comm, *args)`` on every rank; per-rank results in rank order."""
        if not self._procs:
            self._start(None)
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect()

    def _collect(self) -> list[Any]:
        results: dict[int, Any] = {}
        waiting = {c: r for r, c in enumerate(self._conns)} | {
            p.sentinel: r for r, p in enumerate(self._procs)}
        while len(results) < self.world_size:
            for ready in wait(list(waiting)):
                rank = waiting[ready]
                if rank in results:
                    continue
                if ready is self._conns[rank]:
                    try:
                        status, value = ready.recv()
                    except EOFError:
                        status, value = "error", self._death_note(rank)
                elif self._conns[rank].poll():
                    continue  # its result is waiting in the pipe; read it on the next pass
                else:
                    status, value = "error", self._death_note(rank)
                if status == "error":
                    self.abort()
                    raise RankError(rank, value)
                results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def _death_note(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"process died from signal {signal.Signals(-code).name} (no Python traceback)"
        return f"process exited with code {code} before returning a result"

    def abort(self) -> None:
        """Kill every rank now and unlink the world's shared memory."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        self._procs, self._conns = [], []
        unlink_prefix(self.session)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(5)
        self.abort()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int, backend: str = "local", args: tuple = (),
           timeout: float | None = None) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` fresh ranks; ``fn`` may be any callable."""
    world = World(world_size, backend, timeout, job=(fn, tuple(args)))
    try:
        return world._collect()
    finally:
        world.close()


def _serve(wiring: Wiring, rank: int, conn: Any, job: tuple[Callable, tuple] | None) -> None:
    """A rank's life: build the communicator, run jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    comm = LocalComm(wiring, rank)
    try:
        while True:
            if job is None:
                try:
                    job = conn.recv()
                except EOFError:
                    return
                if job is None:
                    return
            fn, args = job
            job = None
            try:
                reply = ("ok", fn(comm, *args))
            except BaseException:
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except Exception:  # e.g. a result that cannot be pickled: say so instead of dying
                conn.send(("error", f"{traceback.format_exc()}\nrank results go back to the "
                                    "launcher by pickle: return numpy arrays, numbers or dicts"))
    finally:
        comm.close()


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this rank if the launcher dies, so no orphan ever waits on a semaphore
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
