"""A rank and whatever it starts: one process group, which ends with the world.

    lead_group()          # in a rank, first thing: its own process group (pgid = its pid)
    adopt(pid)            # in the launcher, right after the fork: the same, from the other side
    kill_group(pid)       # in the launcher, when the world ends: the rank and its descendants
    end_group()           # in a rank, on its way out: every other process of its group

A job may fork (``subprocess.Popen``, ``multiprocessing``, ``os.fork``) inside a rank; its children
inherit the rank's process group, so SIGKILL to the group ends them with the rank, however the
world ends: closed, aborted, or its launcher gone (the rank's watch calls ``end_group``).
Both sides set the group, parent and child, so no moment passes in which a kill could miss it.
A descendant that leaves the group on purpose (``setsid``, a daemon) is its own master.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["lead_group", "adopt", "kill_group", "end_group", "group_members"]


def lead_group() -> None:
    """Make this process the leader of a process group of its own (a no-op where it is already)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader (setsid'd) cannot, and already leads its own
        pass


def adopt(pid: int) -> None:
    """Put the freshly forked ``pid`` in a group of its own, from the launcher's side."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # it did it first, or has already ended: either way it is settled
        pass


def kill_group(pid: int) -> None:
    """SIGKILL the process group that rank ``pid`` leads: the rank and every descendant still in it.
    Never the caller's own group."""
    if pid == os.getpgrp():
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty already, or was never made
        pass


def group_members(pgid: int) -> list[int]:
    """The pids of every live process in group ``pgid`` (read from /proc; empty without it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def end_group() -> None:
    """SIGKILL every other process of the group this process leads (none if it leads none)."""
    me = os.getpid()
    if os.getpgrp() != me:
        return
    for pid in group_members(me):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
