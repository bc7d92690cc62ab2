"""Every process the learner's code starts ends with its check, even one that left its session.

    become_subreaper()           # in the check's first process: orphans below it come back to it
    kill_below(os.getpid())      # SIGKILL every living descendant, until none is left
    stopped_below(pid)           # True if a process under ``pid`` is stopped (SIGSTOP)

A process group or session is not enough: a grandchild that calls ``setsid()`` leaves both, and
once its parent exits it is init's child, out of reach. Linux's child subreaper
(``PR_SET_CHILD_SUBREAPER``) makes such orphans the subreaper's children instead, so walking the
tree of ``/proc/PID/task/*/children`` from the subreaper finds every one of them. Elsewhere the
walk still finds what has not been orphaned yet.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["become_subreaper", "children", "descendants", "kill_below", "stopped_below"]

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the subreaper of everything below it; False where Linux's prctl is not."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """``pid``'s children, from ``/proc`` (none without a /proc, or once ``pid`` is gone)."""
    out: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _state(pid: int) -> str:
    """``pid``'s state letter (R, S, T, Z, ...), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def descendants(pid: int) -> list[int]:
    """Every living (not zombie) process below ``pid``, parents before their children."""
    out, todo = [], children(pid)
    while todo:
        p = todo.pop(0)
        if _state(p) not in ("", "Z", "X"):
            out.append(p)
            todo += children(p)
    return out


def kill_below(pid: int, rounds: int = 100) -> None:
    """SIGKILL every process below ``pid`` until none is left: a killed parent's orphans come back
    to ``pid`` when it is their subreaper, and the next round finds them. When ``pid`` is this
    process, its dead children are reaped as it goes."""
    for _ in range(rounds):
        living = descendants(pid)
        for p in living:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if pid == os.getpid():
            _reap()
        if not living:
            return
        time.sleep(0.005)


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def stopped_below(pid: int) -> bool:
    """Is ``pid`` or a process below it stopped (SIGSTOP) or held by a tracer?"""
    return any(_state(p) in ("T", "t") for p in (pid, *descendants(pid)))
