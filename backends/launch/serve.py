"""What a rank runs: build its communicator, then run jobs until the launcher says stop.

Forked ranks (local, torch) get here through ``multiprocessing`` (``forked_rank``); MPI ranks are
fresh interpreters started by ``mpiexec`` and enter through ``main`` below, which connects back to
the launcher over loopback:

    mpiexec -n 4 python -c \\
        'import sys; from dplab.backends.launch.serve import main; main(sys.argv[1:])' \\
        127.0.0.1:PORT                                            # done for you by World

Every rank watches its launcher (``dplab.backends.launch.watch``): if the launcher dies, the rank
unlinks what it shares and exits within a fraction of a second, whatever it was doing.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from dplab.backends.launch import mainmod
from dplab.backends.launch.group import end_group, lead_group
from dplab.backends.launch.watch import (
    alive_by_token,
    forked_from,
    mapped_mpich_segments,
    unlink_mapped_mpich_segments,
    watch_launcher,
)

__all__ = ["serve", "forked_rank", "threaded_ranks", "receive", "main", "in_rank", "GO"]

Job = tuple[Callable[..., Any], tuple]
GO = b"go"  # the launcher has started every rank: a job given at the fork may begin
_RANK = {"here": False}  # set in a rank's process: a world started from it would be nested


def in_rank() -> bool:
    """Is this process (one of) a world's rank(s)? Then it must not start a world of its own."""
    return _RANK["here"]


def _become_rank() -> None:
    """A rank's first steps: it forgets the imports that died with the fork, rebuilds torch's
    autograd engine, knows it is a rank, and leads a process group of its own."""
    _forget_imports_of_other_threads()
    _rebuild_autograd_engine()
    _RANK["here"] = True
    lead_group()


def _forget_imports_of_other_threads() -> None:
    """In a process just forked: every module that another thread of the launcher was importing
    (an app server's sessions, a notebook's kernel) stays locked here for good, since that thread
    did not survive the fork, and a rank that imports it would wait without end (Python re-makes
    its global import lock after a fork, not each module's). Forget each such lock, and the half
    of the module that ran, so the rank imports it afresh."""
    import importlib._bootstrap as bootstrap

    locks, me = getattr(bootstrap, "_module_locks", {}), threading.get_ident()
    for name, ref in list(locks.items()):
        if getattr(ref(), "owner", None) in (None, me):  # free, or this thread's own import
            continue
        locks.pop(name, None)
        if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False):
            del sys.modules[name]


def _rebuild_autograd_engine() -> None:
    """In a process just forked from one with torch loaded: torch marks its autograd engine stale
    and rebuilds it on the first autograd call, without a lock. Rank threads (cuda, sim) whose
    first forward came at once, just after a collective, rebuilt it together and the process died
    of SIGSEGV. Any call that reaches the engine rebuilds it: one here, in this one thread, before
    they start. (Not a tiny backward: that would also start autograd's thread for each GPU, and
    ask CUDA how many there are, in ranks that may never compute a gradient.)"""
    torch = sys.modules.get("torch")
    if torch is None:  # imported later, in this process: nothing to rebuild
        return
    torch.autograd.Variable._execution_engine.is_checkpoint_valid()


def receive(conn: Any) -> Any:
    """The next message; a job naming the launcher's ``__main__`` gets that script loaded first."""
    data = conn.recv_bytes()
    try:
        return pickle.loads(data)
    except Exception:
        if not mainmod.load_main():
            raise
        return pickle.loads(data)


def serve(connect: Callable[[], Any], conn: Any, job: Job | None = None) -> None:
    """A rank's life: ``connect()`` builds the communicator, then each job is run and answered."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    try:
        comm = connect()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            if job is None:
                try:
                    job = receive(conn)
                except (EOFError, OSError):
                    return
                except Exception:  # e.g. fn of a module this interpreter cannot import
                    conn.send(("error",
                               f"{traceback.format_exc()}\nthis rank could not unpickle the "
                                        "job: define fn at module level of an importable module"))
                    continue
                if job is None:
                    return
            fn, args = job
            job = None
            try:
                with comm.job():  # the sim backend: the job's rank enters virtual time
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


def forked_rank(connect: Callable[[], Any], conn: Any, job: Job | None, launcher_pid: int,
                cleanup: Callable[[], object]) -> None:
    """Entry of a forked (local, torch) rank: watch the launcher, then serve; on the way out, end
    whatever the jobs forked."""
    _become_rank()
    watch_launcher(forked_from(launcher_pid), cleanup)
    one_thread_per_rank()
    # A job given at the fork waits until every rank exists: forking a large world takes
    # seconds, which its first collective's timeout must not be spent on.
    try:
        go = job is None or conn.recv_bytes() == GO
    except (EOFError, OSError):  # the launcher closed the pipe before GO: it is ending the world
        go = False
    try:
        if go:
            serve(connect, conn, job)
    finally:
        end_group()


def threaded_ranks(connect: Callable[[int], Any], conns: list[Any], job: Job | None,
                   launcher_pid: int, cleanup: Callable[[], object]) -> None:
    """Entry of a process whose ranks are threads (cuda): each thread serves its own pipe."""
    _become_rank()
    watch_launcher(forked_from(launcher_pid), cleanup)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    one_thread_per_rank()
    threads = [threading.Thread(target=serve, args=(partial(connect, rank), conn, job), daemon=True,
                                name=f"dplab-rank-{rank}") for rank, conn in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end_group()


def one_thread_per_rank() -> None:
    """A rank is one core's worth of work: NumPy's BLAS and torch run single-threaded in it.

    p ranks that each start a BLAS thread per core fight over the cores (a 256x64 @ 64x64
    matmul took 837 us with 2 OpenBLAS threads per rank on a loaded two-core machine, 48 us
    with one). And if the launcher had used torch, its OpenMP pool did not survive the fork: the
    first parallel kernel here (a copy of a few MiB) would wait forever in libgomp."""
    for set_threads in _openblas_setters():
        set_threads(1)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _openblas_setters() -> list[Callable[[int], object]]:
    """The ``set_num_threads`` of every OpenBLAS this process has loaded (NumPy's wheel bundles
    one under a prefixed name); none where /proc is missing."""
    import ctypes

    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    found = []
    for path in sorted({line.split()[-1] for line in maps if "openblas" in line.lower()}):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, name):
                found.append(getattr(lib, name))
                break
    return found


def main(argv: list[str]) -> None:
    """Entry of an MPI rank started by ``World(..., backend="mpi")``."""
    from multiprocessing.connection import Client

    _become_rank()
    watch_launcher(alive_by_token(os.environ["DPLAB_LAUNCHER"]), unlink_mapped_mpich_segments)
    one_thread_per_rank()
    host, port = argv[0].rsplit(":", 1)
    for path in reversed(os.environ.get("DPLAB_SYS_PATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)  # so pickled functions of the launcher's modules import here
    from dplab.backends.launch.timeouts import default_timeout
    from dplab.backends.mpi.comm import MpiComm

    comm = MpiComm(timeout=default_timeout())
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DPLAB_AUTHKEY"]))
    conn.send((comm.rank, os.getpid(), os.getpgrp(), tuple(mapped_mpich_segments())))

    def stopped_by_mpiexec(signum: int, frame: Any) -> None:
        # mpiexec terminates every rank when one dies: say so, so the launcher can tell the
        # rank that died (its connection just closes) from the ranks that were stopped.
        try:
            conn.send(("stopped", f"rank {comm.rank} was stopped by mpiexec (SIGTERM) because "
                                  "another rank of the job ended"))
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped_by_mpiexec)
    try:
        serve(lambda: comm, conn)
    finally:
        end_group()


if __name__ == "__main__":
    main(sys.argv[1:])
