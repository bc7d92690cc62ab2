"""What a rank runs: build its communicator, then run jobs until the launcher says stop.

Forked ranks (local, torch) get here through ``multiprocessing``; MPI ranks are
fresh interpreters started by ``mpiexec`` and enter through ``main`` below, which
connects back to the launcher over loopback:

    mpiexec -n 4 python -m dplab.backends.launch.serve 127.0.0.1:PORT      # done for you by World
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["serve", "die_with_parent", "main"]

Job = tuple[Callable[..., Any], tuple]


def serve(connect: Callable[[], Any], conn: Any, job: Job | None = None) -> None:
    """A rank's life: ``connect()`` builds the communicator, then each job is run and answered."""
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
                    job = conn.recv()
                except (EOFError, OSError):
                    return
                except Exception:  # e.g. fn defined in the launcher's __main__: not importable here
                    conn.send(("error", f"{traceback.format_exc()}\nthis rank could not unpickle the "
                                        "job: define fn at module level of an importable module"))
                    continue
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


def die_with_parent() -> None:
    try:  # Linux: SIGKILL this rank if the launcher dies, so no orphan waits forever
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    """Entry of an MPI rank started by ``World(..., backend="mpi")``."""
    from multiprocessing.connection import Client

    host, port = argv[0].rsplit(":", 1)
    for path in reversed(os.environ.get("DPLAB_SYS_PATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)  # so pickled functions of the launcher's modules import here
    from dplab.backends.mpi.comm import MpiComm

    timeout = float(os.environ.get("DPLAB_TIMEOUT", "60"))
    comm = MpiComm(timeout=timeout)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DPLAB_AUTHKEY"]))
    conn.send(comm.rank)

    def stopped_by_mpiexec(signum: int, frame: Any) -> None:
        # mpiexec terminates every rank when one dies: say so, so the launcher can tell the
        # rank that died (its connection just closes) from the ranks that were stopped.
        try:
            conn.send(("stopped", f"rank {comm.rank} was stopped by mpiexec (SIGTERM) because "
                                  "another rank of the job ended"))
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped_by_mpiexec)
    serve(lambda: comm, conn)


if __name__ == "__main__":
    main(sys.argv[1:])
