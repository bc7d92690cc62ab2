"""Start an MPI world with the installed ``mpiexec`` and connect its ranks back to us.

``World(p, backend="mpi")`` runs ``mpiexec -n p python -m dplab.backends.launch.serve HOST:PORT``.
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
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from dplab.reference.errors import DplabError

__all__ = ["find_mpiexec", "start_mpiexec", "kill_group", "sweep_mpich_shm"]


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich wheel installs it in the venv
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def start_mpiexec(world_size: int, timeout: float) -> tuple[subprocess.Popen, list[Connection]]:
    """Start the ranks; returns mpiexec's process and one connection per rank, in rank order."""
    sweep_mpich_shm()
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise DplabError("no mpiexec found: pip install 'dplab[mpi]' (mpi4py + the mpich wheel)")
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), backlog=world_size, authkey=key)  # all ranks dial at once
    host, port = listener.address
    env = dict(os.environ, DPLAB_AUTHKEY=key.hex(), DPLAB_TIMEOUT=str(timeout),
               DPLAB_SYS_PATH=os.pathsep.join(p for p in sys.path if p))
    serve = "dplab.backends.launch.serve"
    cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", serve, f"{host}:{port}"]
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


def sweep_mpich_shm(min_age_s: float = 1.0) -> int:
    """Unlink MPICH's shared-memory segments that no live process maps any more.

    MPICH unlinks them in MPI_Finalize; ranks that were killed never get there, so each
    aborted world would leave megabytes in /dev/shm. A segment still mapped by some
    process belongs to a running job and is kept; so is a fresh one (a job starting up).
    """
    shm = Path("/dev/shm")
    candidates = {}
    for path in shm.glob("mpich_shm_*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and time.time() - st.st_mtime >= min_age_s:
            candidates[str(path)] = path
    if not candidates:
        return 0
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        for name in [n for n in candidates if n in text]:
            del candidates[name]
    for path in candidates.values():
        path.unlink(missing_ok=True)
    return len(candidates)
