"""What a lesson's step prints, and what its ranks write to stderr, kept per session.

    with capturing(stdout=io.StringIO(), stderr=file):   # this thread's print() goes there
        world.run(stderr_to, path)                      # each rank's stderr (fd 2) goes to path

An app server runs many visitors' steps at once, one thread each, in one process. So nothing here
touches the process's file descriptors, and nothing swaps ``sys.stdout`` for every thread as
``contextlib.redirect_stdout`` does: ``sys.stdout`` and ``sys.stderr`` become, once, routers that
send a capturing thread's writes to its capture and every other thread's where they went before.
(Swapping fd 2 per session left the server's stderr pointing at another session's deleted file.)
Ranks are processes of their own: each points its own fd 2 at the lab's file.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["capturing", "stderr_to"]

_local = threading.local()  # per thread: "stdout", "stderr" -> where its writes go
_lock = threading.Lock()


class _Router:
    """``sys.stdout`` (or ``sys.stderr``): the calling thread's capture, else the stream it
    replaced."""

    def __init__(self, name: str, before: TextIO) -> None:
        self.name, self.before = name, before

    def _target(self) -> TextIO:
        return getattr(_local, self.name, None) or self.before

    def write(self, text: str) -> int:
        return self._target().write(text)

    def writelines(self, lines: Any) -> None:
        self._target().writelines(lines)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def fileno(self) -> int:  # the process's own: a library's C-level writes are not lost
        return self.before.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...
        return getattr(self._target(), name)


def _route(name: str) -> None:
    with _lock:
        if not isinstance(getattr(sys, name), _Router):
            setattr(sys, name, _Router(name, getattr(sys, name)))


@contextlib.contextmanager
def capturing(stdout: TextIO | None = None, stderr: TextIO | None = None) -> Iterator[None]:
    """Inside, what this thread writes to ``sys.stdout`` / ``sys.stderr`` goes to ``stdout`` /
    ``stderr`` (None: left as it is); other threads' writes are untouched. Nests."""
    _route("stdout")
    _route("stderr")
    saved = getattr(_local, "stdout", None), getattr(_local, "stderr", None)
    if stdout is not None:
        _local.stdout = stdout
    if stderr is not None:
        _local.stderr = stderr
    try:
        yield
    finally:
        _local.stdout, _local.stderr = saved


def stderr_to(comm: Any, path: str) -> None:
    """Run on every rank (``world.run(stderr_to, path)``): its file descriptor 2, and so what it
    and any library write to stderr, appends to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
    finally:
        os.close(fd)
