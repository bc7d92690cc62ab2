"""Named shared-memory segments: files in /dev/shm, mapped, whose lifetime the launcher owns.

Python's ``SharedMemory`` is not used: it registers every segment it attaches with a resource
tracker that unlinks it when the attaching process exits, and its ``close`` unmaps memory that
numpy views still point at. dplab's launcher owns the lifetime of its
segments instead: every name starts with the world's session prefix, and the
launcher unlinks everything with that prefix when the world ends, however its
ranks ended (and if the launcher itself dies, its ranks do: ``dplab.backends.launch.watch``).
``sweep_stale`` removes segments of worlds whose launcher died, skipping those of other
users, which we may not remove.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path

import numpy as np

from dplab.reference.errors import ConfigError

__all__ = ["PREFIX", "Segment", "ShmFull", "shm_full", "unlink_prefix", "sweep_stale", "leftovers",
           "mine", "process_alive"]

PREFIX = "dplab_"
SHM_DIR = Path("/dev/shm")


class ShmFull(ConfigError):
    """/dev/shm has no room for a segment: says how much was needed and how much is free."""


class Segment:
    """One mapped segment, exposed as a uint8 array; ``view`` carves typed arrays out of it.

    The mapping is never unmapped by hand: ``close`` drops this object's reference, and the kernel
    mapping goes with the last numpy view of it. A numpy array made over a buffer keeps the mmap
    object alive but holds no export of it, so ``mmap.close()`` would unmap memory under views
    still in use (a SIGSEGV on the next read). Reading through any view is therefore always safe.
    A new segment's pages are reserved at creation (``posix_fallocate``): a full /dev/shm is a
    ``ShmFull`` here, not a SIGBUS at the first write to a page tmpfs could not supply.
    """

    def __init__(self, name: str, size: int = 0, create: bool = False) -> None:
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                _reserve(fd, path, max(size, 1))
            self._mmap = mmap.mmap(fd, 0 if not create else max(size, 1))
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self.name = name
        self.bytes = np.frombuffer(self._mmap, dtype=np.uint8)

    def view(self, offset: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        return self.bytes[offset:offset + nbytes].view(dtype)

    def unlink(self) -> None:
        try:
            (SHM_DIR / self.name).unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Forget the mapping; it is unmapped once no view of it is left (see the class)."""
        self.bytes = self._mmap = None  # type: ignore[assignment]


def _reserve(fd: int, path: Path, size: int) -> None:
    """Give the new segment ``size`` bytes of /dev/shm now, or unlink it and raise ``ShmFull``."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise shm_full(size, f"segment {path.name}") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate
            raise
        os.ftruncate(fd, size)  # pragma: no cover - tmpfs supports fallocate


def shm_full(need: int, what: str) -> ShmFull:
    """The one-line error for a full /dev/shm: what needed how much, and how much is free."""
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        free = 0
    return ShmFull(f"{SHM_DIR} is full: {_mib(need)} needed for {what}, {_mib(free)} free; "
                   f"free space in {SHM_DIR} (df -h {SHM_DIR}; remove what dead jobs left) "
                   f"or enlarge it (mount -o remount,size=... {SHM_DIR})")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


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
        if pid.isdigit() and not process_alive(int(pid)):
            n += unlink_prefix(f"{PREFIX}{pid}_")
    return n


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Names in /dev/shm that start with ``prefix``: pass this process's, ``mine()``, to see only
    what its own worlds made (another dplab job on the machine has segments of its own)."""
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*"))


def mine() -> str:
    """The prefix of every segment of the worlds this process launches."""
    return f"{PREFIX}{os.getpid()}_"


def process_alive(pid: int) -> bool:
    """Is ``pid`` a live process? A killed child the launcher has not reaped yet is a zombie:
    it still "exists" for ``os.kill(pid, 0)``, so read its state from /proc instead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
