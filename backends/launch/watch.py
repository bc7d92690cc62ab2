"""A rank's lifeline: once the launcher that started it is gone, the rank cleans up and ends itself.

    stop = watch_launcher(forked_from(launcher_pid), cleanup=lambda: unlink_prefix(session))

A daemon thread looks at the launcher five times a second; once it is gone (SIGKILL, the OOM
killer, a closed terminal) the thread runs ``cleanup`` (the world's segments, and on MPI the MPICH
segments this rank maps) and ends the process with ``os._exit``. A forked rank compares
``getppid()`` with the launcher's pid; an MPI rank checks that the pid still names a live process
with the start time it had. Why not ``PR_SET_PDEATHSIG`` or EOF on a pipe: backends/README.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dplab.backends.launch.group import end_group

__all__ = ["POLL_S", "process_start", "launcher_token", "forked_from", "alive_by_token",
           "watch_launcher", "mapped_mpich_segments", "unlink_mapped_mpich_segments"]

POLL_S = 0.2  # how often a rank looks at its launcher: at most this long an orphan keeps running


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def launcher_token(pid: int | None = None) -> str:
    """``pid:start``: what an MPI rank needs to recognise this launcher
    (passed in its environment)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start(pid) or 0}"


def forked_from(launcher_pid: int) -> Callable[[], bool]:
    """For a forked rank: is the process that forked us still our parent?"""
    return lambda: os.getppid() == launcher_pid


def alive_by_token(token: str) -> Callable[[], bool]:
    """For an MPI rank: does the launcher named by ``launcher_token()`` still run?"""
    pid, start = token.split(":", 1)
    return lambda: process_start(int(pid)) == start


def watch_launcher(alive: Callable[[], bool], cleanup: Callable[[], object] = lambda: None,
                   code: int = 1, poll_s: float = POLL_S) -> threading.Thread:
    """Start the daemon thread that ends this process (after
    ``cleanup``) once ``alive()`` is False."""

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        try:
            cleanup()
        finally:
            end_group()  # what the rank's jobs forked goes with it
            os._exit(code)

    if not alive():  # the launcher died while we started: do not even begin
        watch()
    thread = threading.Thread(target=watch, name="dplab-launcher-watch", daemon=True)
    thread.start()
    return thread


def mapped_mpich_segments(pid: int | str = "self") -> list[str]:
    """Paths of the MPICH shared-memory segments a process maps (empty
    if it maps none or is gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    found = {
        line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/dev/shm/mpich_shm_" in line
    }
    return sorted(p for p in found if not p.endswith("(deleted)"))


def unlink_mapped_mpich_segments() -> None:
    """MPICH unlinks its segments in MPI_Finalize; a rank ending without it does it here."""
    for path in mapped_mpich_segments():
        try:
            os.unlink(path)
        except OSError:
            pass
