"""One incarnation of a world's ranks: start them, talk to them, end them (gently or at once).

    ranks = start_ranks("local", 4, session, timeout=60.0, job=None)
    ranks.send_all(payload)          # a pickled job to every rank
    ranks.stop(grace_s=5)            # ask them to stop, then make sure
    ranks.kill()                     # SIGKILL now, unlink the world's shared memory

Local and torch ranks are forked (``multiprocessing``, fork context), each with a pipe back to the
launcher; cuda ranks are threads of one forked process, each with its own pipe; MPI ranks are
started by mpiexec (``dplab.backends.mpi.mpiexec``) and dial back over loopback. Either way
``kill`` leaves nothing: no process, no segment with the world's prefix, no MPICH segment of its
ranks. It runs at most once, and only in the process that started the ranks
(a forked child that inherited this object must not kill its parent's world).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

from dplab.backends.launch import mainmod
from dplab.backends.launch.group import adopt, kill_group
from dplab.backends.launch.serve import GO, forked_rank, threaded_ranks
from dplab.backends.launch.timeouts import start_timeout
from dplab.backends.launch.watch import launcher_token
from dplab.backends.local.shm import unlink_prefix
from dplab.backends.mpi.mpiexec import MpiJob, start_mpiexec
from dplab.backends.registry import Backend, entry
from dplab.reference.errors import ConfigError

__all__ = ["Ranks", "start_ranks", "pickle_job"]

Job = tuple[Callable[..., Any], tuple]


class Ranks:
    """The processes and pipes of one start of a world; ``conns[r]`` talks to rank ``r``."""

    def __init__(self, session: str, conns: list[Any], procs: list[Any] | None = None,
                 mpi: MpiJob | None = None, keep: Any = None) -> None:
        self.session, self.conns, self.procs, self.mpi = session, conns, procs or [], mpi
        self._keep = keep  # the local backend's wiring: its shared heap must outlive the ranks
        self._owner = os.getpid()
        self._killed = False

    def sentinels(self) -> dict[Any, int]:
        """What to ``wait`` on: each rank's pipe, and each forked rank's process sentinel."""
        return ({c: r for r, c in enumerate(self.conns)}
                | {p.sentinel: r for r, p in enumerate(self.procs)})

    def send_all(self, payload: bytes) -> None:
        """Send a pickled message to every rank; a dead rank's broken
        pipe is left to ``collect``."""
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError:  # BrokenPipeError, ConnectionResetError: it died, its EOF will tell
                pass

    def death_notes(self, ranks: list[int]) -> dict[int, str | None]:
        """How each of ``ranks`` ended, in the same words on every backend; None where unknown."""
        if self.mpi is not None:
            return self.mpi.death_notes(ranks)
        notes: dict[int, str | None] = {}
        for rank in ranks:
            proc = self.procs[rank]
            proc.join(1)
            code = proc.exitcode
            if code is not None and code < 0:
                notes[rank] = (
                    f"process died from signal {signal.Signals(-code).name} (no Python traceback)"
                )
            else:
                notes[rank] = f"process exited with code {code} before returning a result"
        return notes

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask every rank to stop (a ``None`` job), give them ``grace_s`` in all, then ``kill``."""
        self.send_all(pickle.dumps(None))
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
        if self.mpi is not None and not self._killed and os.getpid() == self._owner:
            self.mpi.wait(max(deadline - time.monotonic(), 0) + 5)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank now, with whatever it forked (its process group: ``group``), and
        unlink the world's shared memory (once, in the owner only)."""
        if self._killed or os.getpid() != self._owner:
            return
        self._killed = True
        for pid in dict.fromkeys(proc.pid for proc in self.procs):  # cuda: one process, many ranks
            kill_group(pid)  # a rank that ended already may have left children in its group
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        if self.mpi is not None:
            self.mpi.kill()
        for conn in self.conns:
            conn.close()
        unlink_prefix(self.session)


def start_ranks(backend: str, world_size: int, session: str, timeout: float, job: Job | None,
                cluster: Any = None) -> Ranks:
    """Start ``world_size`` ranks of ``backend``, as its registry entry says; with ``job`` each runs
    it first, unasked. ``cluster``: the simulated cluster of a ``simulated`` backend (sim)."""
    found = entry(backend)
    if found.simulated:
        found = replace(found, prepare=partial(found.prepare, cluster=cluster))
    return _STARTS[found.start](found, world_size, session, timeout, job)


def _import_before_fork() -> None:
    """Where this process uses torch, import what each forked rank would otherwise import by
    itself: a rank's first ``optimizer.step()`` imports ``torch._dynamo`` (about 2 CPU-s, so 8
    for a world of 4 on two cores); imported here once, every fork inherits it."""
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401


def _start_forked(found: Backend, world_size: int, session: str, timeout: float,
                  job: Job | None) -> Ranks:
    _import_before_fork()
    ctx = mp.get_context("fork")
    backend = found.name
    connect, keep = found.prepare(ctx, session, world_size, timeout)
    ranks = Ranks(session, [], [], keep=keep)
    # A rank's full collection would walk every object it inherited (a launcher with torch
    # loaded holds a great many), writing to each, so the rank copies every page they sit on.
    # Frozen, the inherited objects are left alone in the ranks; the launcher unfreezes its own
    # once the ranks are forked.
    gc.freeze()
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=forked_rank, daemon=True, name=f"dplab-{backend}-rank-{rank}",
                               args=(partial(connect, rank), child, job, os.getpid(),
                                     partial(unlink_prefix, session)))
            proc.start()
            adopt(proc.pid)  # its own process group, so that the world's end takes its children too
            child.close()
            ranks.conns.append(parent)
            ranks.procs.append(proc)
    except BaseException:
        ranks.kill()
        raise
    finally:
        gc.unfreeze()
    if job is not None:
        ranks.send_all(GO)  # every rank is forked: the job may start (serve.forked_rank)
    return ranks


def pickle_job(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` as the bytes every rank receives; one clear error if that is impossible."""
    try:
        return bytes(ForkingPickler.dumps((fn, tuple(args))))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ConfigError(f"cannot send {getattr(fn, '__qualname__', fn)!r} to the ranks: "
                          f"{e}. Jobs of a persistent World and of MPI ranks travel by pickle: "
                          "define fn at module level (launch() on local or torch forks, and takes "
                          "any callable)") from None


def _start_mpi(found: Backend, world_size: int, session: str, timeout: float,
               job: Job | None) -> Ranks:
    payload = pickle_job(*job) if job is not None else None  # before anything starts
    env = {"DPLAB_LAUNCHER": launcher_token()}
    spec = mainmod.main_spec()
    if spec is not None:
        env[mainmod.ENV] = spec
    try:
        mpi = start_mpiexec(world_size, timeout, start_timeout(), session, env)
    except BaseException:  # ranks that started wrote their exit files under the session's prefix
        unlink_prefix(session)
        raise
    ranks = Ranks(session, mpi.conns, mpi=mpi)
    if payload is not None:
        ranks.send_all(payload)
    return ranks


def _start_threads(found: Backend, world_size: int, session: str, timeout: float,
                   job: Job | None) -> Ranks:
    """One forked process holding every rank as a thread, each with its own pipe to the launcher:
    the launcher sees ``world_size`` ranks that share one process (and die together)."""
    ctx = mp.get_context("fork")
    connect, keep = found.prepare(ctx, session, world_size, timeout)
    pipes = [ctx.Pipe() for _ in range(world_size)]
    proc = ctx.Process(target=threaded_ranks, daemon=True, name=f"dplab-{found.name}-ranks",
                       args=(connect, [child for _, child in pipes], job, os.getpid(),
                             partial(unlink_prefix, session)))
    proc.start()
    adopt(proc.pid)
    for _, child in pipes:
        child.close()
    return Ranks(session, [parent for parent, _ in pipes], [proc] * world_size, keep=keep)


# an entry's ``start``
_STARTS = {"fork": _start_forked, "threads": _start_threads, "mpiexec": _start_mpi}
