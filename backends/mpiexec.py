"""Start an MPI world with the installed ``mpiexec`` and connect its ranks back to us.

``World(p, backend="mpi")`` runs ``mpiexec -n p python -m backends.serve HOST:PORT``.
Each rank (a fresh interpreter, so jobs must be module-level functions) connects to
a listener on loopback, authenticated by a random key passed in the environment,
and says which rank it is. mpiexec runs in its own session so that one signal to
its process group stops every rank it started.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from reference.errors import DplabError

__all__ = ["find_mpiexec", "start_mpiexec", "kill_group"]


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich wheel installs it in the venv
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def start_mpiexec(world_size: int, timeout: float) -> tuple[subprocess.Popen, list[Connection]]:
    """Start the ranks; returns mpiexec's process and one connection per rank, in rank order."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise DplabError("no mpiexec found: pip install 'dplab[mpi]' (mpi4py + the mpich wheel)")
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), backlog=world_size, authkey=key)  # all ranks dial at once
    host, port = listener.address
    env = dict(os.environ, DPLAB_AUTHKEY=key.hex(), DPLAB_TIMEOUT=str(timeout),
               DPLAB_SYS_PATH=os.pathsep.join(p for p in sys.path if p))
    cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", "backends.serve", f"{host}:{port}"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    conns: list[Connection] = []

    def accept_all() -> None:
        for _ in range(world_size):
            conns.append(listener.accept())

    accepter = threading.Thread(target=accept_all, daemon=True)
    accepter.start()
    accepter.join(timeout)
    listener.close()
    if len(conns) < world_size:
        kill_group(proc)
        raise DplabError(f"only {len(conns)} of {world_size} MPI ranks connected within {timeout:.0f}s "
                         f"(mpiexec: {' '.join(cmd)})")
    by_rank = {c.recv(): c for c in conns}
    return proc, [by_rank[r] for r in range(world_size)]


def kill_group(proc: subprocess.Popen) -> None:
    """Stop mpiexec and every rank it started (they share its process group)."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
