"""Ctrl-C and SIGTERM: stop every rank at once, clean up even under a second signal, say one line.

    rows = interruptible("dplab train", command, args)   # the CLI: exit 130 (SIGINT), 143 (SIGTERM)
    with signals_deferred():                              # a cleanup no signal may cut in half
        kill_ranks(); unlink_segments()

Ctrl-C reaches the launcher as KeyboardInterrupt; ``launch`` and ``World.run`` then kill the ranks
(SIGKILL: a rank in the middle of a step has nothing worth saving) and unlink the world's shared
memory. That cleanup runs inside ``signals_deferred``: a second Ctrl-C (or a SIGTERM) arriving in
the middle of it is held until the cleanup is done, instead of leaving half of /dev/shm behind.

``interruptible`` is what the ``dplab`` command wraps around its work: it turns SIGTERM into an
exception too (Python's default is to die on the spot, skipping every cleanup), ignores further
signals once the first one is being handled (the cleanup is bounded: kills and joins with
timeouts), and replaces the traceback with one line and the shell's exit code 128 + signal.
Being the end of the process, it leaves SIGINT and SIGTERM ignored on that path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["Terminated", "interruptible", "signals_deferred"]

T = TypeVar("T")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered like Ctrl-C so that the same cleanup runs
    (inside ``interruptible`` only)."""


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs; then act on the first one that came.

    Outside the main thread Python cannot install handlers (and signals go to the main thread
    anyway), so there the block simply runs.

    Yields:
        None, with the two signals held until the block ends.
    """
    if not _in_main_thread():
        yield
        return
    arrived: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if arrived:
            _deliver(arrived[0], saved[arrived[0]])


def _deliver(sig: int, handler: Any) -> None:
    """Act on a held signal as its own handler would have."""
    if callable(handler):
        handler(sig, None)
    elif handler == signal.SIG_DFL:
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        # the default action (SIGTERM: end the process), now that we are clean
        os.kill(os.getpid(), sig)


def interruptible(prog: str, fn: Callable[..., T], *args: Any, say: bool = True) -> T:
    """Run ``fn(*args)``; on SIGINT/SIGTERM, once the ranks are cleaned up, print one line and exit.

    Further signals while stopping are ignored: stopping is bounded.

    Args:
        prog: the command's name, the start of the one line (``dplab train: interrupted``).
        fn: the work, which cleans up its ranks as KeyboardInterrupt passes through it.
        *args: passed to ``fn``.
        say: print the line. False for ranks of an engine launcher's job other than rank 0,
            which speaks for the job: its launcher stops them all at once when one ends.

    Returns:
        ``fn``'s result.

    Raises:
        SystemExit: 130 for SIGINT and 143 for SIGTERM, as a shell reports a command that a signal
            ended.
    """
    if not _in_main_thread():
        return fn(*args)
    first: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if first:
            return  # already stopping: the cleanup is under way and bounded
        first.append(signum)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    saved = {sig: signal.signal(sig, handler) for sig in _SIGNALS}
    try:
        result = fn(*args)
    except KeyboardInterrupt:
        # The ranks are cleaned up and this process is on its way out: from here on signals are
        # ignored (SIG_IGN, which the interpreter's shutdown keeps, unlike a Python handler), so a
        # second Ctrl-C cannot turn the one line into a traceback or the exit code into -2.
        sig = first[0] if first else signal.SIGINT
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        if say:
            word = "terminated" if sig == signal.SIGTERM else "interrupted"
            print(f"{prog}: {word}", file=sys.stderr, flush=True)
        raise SystemExit(128 + sig) from None
    except BaseException:
        _restore(saved)
        raise
    _restore(saved)
    return result


def _restore(saved: dict[int, Any]) -> None:
    for sig, previous in saved.items():
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
