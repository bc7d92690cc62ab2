"""The files a user names: read only regular files, only as many bytes as make sense; write whole
files or none.

    data = read_regular("run.ckpt", limit=1 << 20, what="checkpoint")  # bytes, or a ConfigError
    write_atomic("rows.json", text.encode(), what="--json")        # all of it, or a WriteError

A path a user gives may be a link to ``/dev/zero`` (endless), a FIFO (a read that never returns)
or a 30 GB sparse file: ``read_regular`` opens without blocking, refuses anything but a regular
file and checks the size against ``limit`` before reading a byte, then reads at most that much.
``write_atomic`` writes a temporary file beside the target, fsyncs it and renames it over the
target, so a full disk, a read-only directory or a crash leaves the old file as it was (or no
file), never half of a new one; a link is written through to its target, as ``open`` would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, BinaryIO

from dplab.reference.errors import ConfigError

__all__ = ["WriteError", "open_regular", "read_regular", "write_atomic", "real_target", "size_text"]


class WriteError(ConfigError, OSError):
    """An output could not be written (a full disk, a read-only place, a directory in the way);
    whatever was there before is still there. An ``OSError`` too (its ``errno`` is the cause's),
    and a ``ConfigError``: the command line says it in one line, exit 2."""


def size_text(n: int) -> str:
    """Bytes for a reader: ``1.5 GiB``, ``12.0 MiB``, ``640 B``.

    Args:
        n: bytes.

    Returns:
        The size with a binary unit.
    """
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, limit: int, what: str) -> Iterator[BinaryIO]:
    """A binary file object of ``path``, a regular file of at most ``limit`` bytes, else one
    ``ConfigError`` naming ``what``. Opened with O_NONBLOCK, so a FIFO is refused, not waited on.

    Args:
        path: the file.
        limit: the most bytes it may hold.
        what: what it is, for the message ("checkpoint", "trace").

    Yields:
        The open binary file.

    Raises:
        ConfigError: the path cannot be opened, is not a regular file, or is larger than ``limit``.
    """
    try:
        _check_kind(os.stat(path), path, limit, what)  # a device is refused without opening it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path} ({e.strerror}): check the path") from None
    try:
        _check_kind(os.fstat(fd), path, limit, what)  # the file opened is the file checked
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def _check_kind(st: os.stat_result, path: str | os.PathLike, limit: int, what: str) -> None:
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise ConfigError(f"{what} {path} is {kind}, not a regular file: give the file itself")
    if st.st_size > limit:
        raise ConfigError(f"{what} {path} is {size_text(st.st_size)}, more than the "
                          f"{size_text(limit)} one can be here: give the right file")


def read_regular(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (``open_regular``); a file
    that grows while it is read is cut at ``limit + 1`` bytes and refused.

    Args:
        path: the file.
        limit: the most bytes it may hold.
        what: what it is, for the message.

    Returns:
        Its bytes.

    Raises:
        ConfigError: as ``open_regular``, or the file grew past ``limit`` while it was read.
    """
    with open_regular(path, limit, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{what} {path} grew past {size_text(limit)} while it was read: "
                          "give a file nothing else is writing")
    return data


def real_target(path: str | os.PathLike, what: str = "output") -> Path:
    """Where writing ``path`` lands: a link followed to its target (a link to nowhere is fine: the
    write creates the target; a loop of links is a ConfigError).

    Args:
        path: the path a user named.
        what: what it is, for the message.

    Returns:
        The path the write will create or replace.

    Raises:
        ConfigError: a loop of links.
    """
    p = Path(path)
    if not p.is_symlink():
        return p
    try:
        return Path(os.path.realpath(p, strict=True))
    except FileNotFoundError:
        return Path(os.path.realpath(p))
    except OSError as e:
        raise ConfigError(f"{what} {path} is a symbolic link that cannot be followed "
                          f"({e.strerror}): remove the link or choose another path") from None


def write_atomic(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], object],
                 what: str) -> Path:
    """Write ``data`` (bytes, or a function that writes to a binary file) to ``path`` whole or not
    at all: a temporary file beside it, fsynced, renamed over it. Returns the path written.

    Args:
        path: where to write (a link is followed to its target).
        data: the bytes, or a function that writes them to the file it is given.
        what: what it is, for the message.

    Returns:
        The path written (a link's target).

    Raises:
        WriteError: in one line, what could not be written and why; what was at ``path``
            before is untouched, and the temporary file is gone (or named, where the file
            system refuses to delete it: one remounted read-only).
    """
    target = real_target(path, what)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise _failed(what, path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open would honour umask
        os.replace(tmp, target)
    except BaseException as e:
        left = None
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:  # a file system remounted read-only keeps what it already holds
            left = tmp
        if isinstance(e, OSError):
            raise _failed(what, path, e, left) from None
        raise
    return target


def _failed(what: str, path: str | os.PathLike, e: OSError, left: str | None = None) -> WriteError:
    fix = "free space or choose another place" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
        "choose another place"
    rest = "nothing was left half-written" if left is None else \
        f"{path} is untouched but the file system kept the unfinished {left}: delete it"
    error = WriteError(f"{what}: cannot write {path} ({e.strerror}): {fix}; {rest}")
    error.errno = e.errno  # (not strerror: OSError would print "[Errno n] ..." instead of ours)
    return error


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):  # no /proc: the common default
        return 0o022
