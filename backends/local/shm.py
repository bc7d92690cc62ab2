"""Named shared-memory segments that no resource tracker unlinks behind our back.

Python's ``SharedMemory`` registers every segment, even one it merely attaches,
with a resource tracker that unlinks it when the attaching process exits
(fixed in 3.13 with ``track=False``). dplab's launcher owns the lifetime of its
segments instead: every name starts with the world's session prefix, and the
launcher unlinks everything with that prefix when the world ends, however its
ranks ended (and if the launcher itself dies, its ranks do: ``dplab.backends.launch.watch``).
``sweep_stale`` removes segments of worlds whose launcher died, skipping those of other
users, which we may not remove.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

__all__ = ["PREFIX", "Segment", "unlink_prefix", "sweep_stale", "leftovers"]

PREFIX = "dplab_"
SHM_DIR = Path("/dev/shm")


class Segment:
    """One mapped segment, exposed as a uint8 array; ``view`` carves typed arrays out of it."""

    def __init__(self, name: str, size: int = 0, create: bool = False) -> None:
        self._shm = _untracked(name, create, max(size, 1))
        os.close(self._shm._fd)  # the mapping keeps the memory; the descriptor is not needed
        self._shm._fd = -1  # type: ignore[attr-defined]
        self.name = name
        self.bytes = np.ndarray((self._shm.size,), dtype=np.uint8, buffer=self._shm.buf)

    def view(self, offset: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        return self.bytes[offset:offset + nbytes].view(dtype)

    def unlink(self) -> None:
        try:
            (SHM_DIR / self.name).unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:  # a caller still holds a view; the mapping dies with the process
            pass


def _untracked(name: str, create: bool, size: int) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name, create=create, size=size, track=False)
    register = resource_tracker.register  # before 3.13 there is no track=False: mute it briefly
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return SharedMemory(name, create=create, size=size)
    finally:
        resource_tracker.register = register


def unlink_prefix(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix`` that we may remove; returns how many.

    One we may not remove (another user's, in the sticky /dev/shm) is skipped: it is not ours,
    and it must never stop a launch.
    """
    n = 0
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            path.unlink()
            n += 1
        except (FileNotFoundError, PermissionError):
            pass
    return n


def sweep_stale() -> int:
    """Unlink segments of dead launchers (names are ``dplab_<launcher pid>_...``), where we may."""
    n = 0
    for path in SHM_DIR.glob(PREFIX + "*"):
        pid = path.name[len(PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            n += unlink_prefix(f"{PREFIX}{pid}_")
    return n


def leftovers() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
