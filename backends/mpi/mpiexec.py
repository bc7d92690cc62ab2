"""Start an MPI world with the installed ``mpiexec``, connect its ranks back to us, end it cleanly.

``World(p, backend="mpi")`` runs ``mpiexec -n p python -c RANK_MAIN HOST:PORT``; each rank connects
to a listener on loopback (authenticated by a random key in its environment) and reports its rank,
pid, process group and MPICH shared-memory segments. ``kill`` signals both mpiexec's and the ranks'
process groups and unlinks the segments killed ranks leave; ``death_note`` says how a rank ended
("process exited with code 3"), as the keeper process that mpiexec starts for each rank recorded it
(why a keeper: backends/README.md). Start-up has its own allowance, ``DPLAB_START_TIMEOUT``.
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
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from dplab.backends.local.shm import shm_full
from dplab.reference.errors import DplabError

__all__ = ["find_mpiexec", "start_mpiexec", "MpiJob", "RankInfo", "kill_group", "sweep_mpich_shm",
           "check_mpich_room", "MPICH_SHM_PER_RANK"]

# The keeper: fork the rank, pass SIGTERM on, record an abnormal end, end the same way. It imports
# nothing of dplab (importing the package costs a second of numpy and friends per process).
RANK_MAIN = """
import os, signal, sys
keeper = os.getpid()
rank = os.fork()
if rank == 0:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the rank ends with its keeper
    if os.getppid() != keeper:
        os._exit(1)
    from dplab.backends.launch.serve import main
    main(sys.argv[1:])
    sys.exit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(rank, signum))
status = os.waitpid(rank, 0)[1]
pid, start = os.environ["DPLAB_LAUNCHER"].split(":")
try:
    launcher = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
except OSError:
    launcher = ["X"]
if status != 0 and launcher[0] not in ("Z", "X") and launcher[19] == start:  # someone to read it
    with open(os.environ["DPLAB_EXIT_PREFIX"] + str(rank), "w") as f:
        f.write(str(status))
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(keeper, sig)
os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
"""


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich wheel installs it in the venv
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@dataclass(frozen=True)
class RankInfo:
    """What an MPI rank tells the launcher when it connects."""

    rank: int
    pid: int
    pgid: int
    segments: tuple[str, ...]  # MPICH's /dev/shm segments this rank maps


class MpiJob:
    """A running mpiexec job: its process, one connection per rank
    (rank order), and how to end it."""

    def __init__(self, proc: subprocess.Popen, world_size: int, exit_prefix: str) -> None:
        self.proc, self.world_size, self.exit_prefix = proc, world_size, exit_prefix
        self.conns: list[Connection] = []
        self.ranks: list[RankInfo] = []

    def death_notes(self, ranks: list[int]) -> dict[int, str | None]:
        """How each of ``ranks`` ended, from its keeper's record; None where there is none.

        The rank that ended first has a record; the ranks mpiexec then SIGKILLed with their
        keepers have none. So a record also tells the cause from the casualties.
        """
        records = {r: Path(self.exit_prefix + str(self.ranks[r].pid)) for r in ranks
                   if r < len(self.ranks)}
        deadline = time.monotonic() + 2  # a keeper writes its record just after its rank ends
        while (records and not any(p.exists() for p in records.values())
               and time.monotonic() < deadline):
            time.sleep(0.01)
        notes: dict[int, str | None] = dict.fromkeys(ranks)
        for rank, record in records.items():
            try:
                status = int(record.read_text())
            except (OSError, ValueError):
                continue
            if os.WIFSIGNALED(status):
                name = _signame(os.WTERMSIG(status))
                notes[rank] = f"process died from signal {name} (no Python traceback)"
            elif os.WIFEXITED(status):
                notes[rank] = (
                    f"process exited with code {os.WEXITSTATUS(status)} before returning a result"
                )
        return notes

    def kill(self) -> None:
        """SIGKILL mpiexec and every rank now; unlink the MPICH segments they can no longer unlink.

        The segments go first: every rank that reported them has them mapped already (unlinking
        only removes the name), and no moment passes with a dead job's segment in /dev/shm.
        """
        for info in self.ranks:
            for path in info.segments:
                Path(path).unlink(missing_ok=True)
        for group in {info.pgid for info in self.ranks} - {os.getpgrp()}:  # never our own group
            _killpg(group, signal.SIGKILL)
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        pids = [info.pid for info in self.ranks]
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.01)
        # Ranks that never said what they map (a failed start), and jobs of this user's own mpiexec
        # that MPI_Abort left behind: whatever no live process maps any more.
        sweep_mpich_shm(min_age_s=0.0)
        for conn in self.conns:
            conn.close()

    def wait(self, timeout: float) -> None:
        """Let mpiexec end by itself (the ranks were told to stop), then make sure of it."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def start_mpiexec(world_size: int, timeout: float, start_timeout: float, session: str,
                  env: dict[str, str] | None = None) -> MpiJob:
    """Start the ranks; within ``start_timeout`` every one connects, or nothing is left running."""
    sweep_mpich_shm()
    check_mpich_room(world_size)
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise DplabError("no mpiexec found: pip install 'dplab[mpi]' (mpi4py + the mpich wheel)")
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), backlog=world_size, authkey=key)  # all ranks dial at once
    host, port = listener.address
    exit_prefix = f"/dev/shm/{session}_exit_"
    env = dict(os.environ, **(env or {}), DPLAB_AUTHKEY=key.hex(), DPLAB_TIMEOUT=repr(timeout),
               DPLAB_SYS_PATH=os.pathsep.join(p for p in sys.path if p),
               DPLAB_EXIT_PREFIX=exit_prefix)
    cmd = [mpiexec, "-n", str(world_size), sys.executable, "-c", RANK_MAIN, f"{host}:{port}"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    job = MpiJob(proc, world_size, exit_prefix)
    try:
        _connect(job, listener, world_size, start_timeout)
    except BaseException:
        job.kill()
        raise
    finally:
        listener.close()
    return job


# MPICH's shared-memory transport maps about 1 MiB of /dev/shm per rank on one host (its
# eager cells); without it MPI_Init fails with MPICH's own multi-line banner.
MPICH_SHM_PER_RANK = 1100 * 1024


def check_mpich_room(world_size: int) -> None:
    """``ShmFull`` in one line, before mpiexec starts, when /dev/shm
    cannot hold MPICH's segments."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return  # no /dev/shm: MPICH picks another transport
    if free < world_size * MPICH_SHM_PER_RANK:
        raise shm_full(world_size * MPICH_SHM_PER_RANK,
                       f"MPICH's shared memory of {world_size} ranks")


def _connect(job: MpiJob, listener: Listener, world_size: int, allowance: float) -> None:
    accepted: list[Connection] = []

    def accept_all() -> None:
        try:
            for _ in range(world_size):
                accepted.append(listener.accept())
        except OSError:  # the listener was closed: we gave up
            pass

    deadline = time.monotonic() + allowance
    accepter = threading.Thread(target=accept_all, name="dplab-mpi-accept", daemon=True)
    accepter.start()
    while accepter.is_alive() and time.monotonic() < deadline and job.proc.poll() is None:
        accepter.join(0.05)
    job.conns = list(accepted)
    infos = []
    for conn in job.conns:
        if not conn.poll(max(deadline - time.monotonic(), 0.5)):
            break
        infos.append(RankInfo(*conn.recv()))
    job.ranks = sorted(infos, key=lambda info: info.rank)
    if len(infos) == world_size == len(job.conns):
        by_rank = dict(zip([info.rank for info in infos], job.conns))
        job.conns = [by_rank[r] for r in range(world_size)]
        return
    if job.proc.poll() is not None:
        raise DplabError(f"mpiexec exited with code {job.proc.returncode} after {len(infos)} of "
                         f"{world_size} MPI ranks connected (its output is above)")
    raise DplabError(f"only {len(infos)} of {world_size} MPI ranks connected within "
                     f"{allowance:g}s: set DPLAB_START_TIMEOUT to give start-up more time")


def _killpg(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def kill_group(proc: subprocess.Popen) -> None:
    """Stop mpiexec and what it started: SIGTERM (mpiexec passes it on), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        _killpg(proc.pid, sig)
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
        age = time.time() - st.st_mtime
        if st.st_uid == os.getuid() and age >= min_age_s:
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
        try:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass
    return len(candidates)
