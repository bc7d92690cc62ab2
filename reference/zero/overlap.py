"""One communication thread per rank: collectives run in the order they were handed over.

    comm_thread = CommThread(comm)
    h = comm_thread.submit(allgather, comm, buf, "ring")   # returns at once
    ...compute while buf is gathered...
    h.wait()                                               # buf is complete now
    comm_thread.close()

Every rank submits its collectives in program order and the thread runs them in that order,
so the ranks agree whatever the compute's timing (why: ``dplab.reference.train.buckets``). A
collective's error, or no progress for ``comm.timeout`` plus a margin, reaches the caller
through ``wait``; after an error the rest of the queue is skipped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dplab.reference.communicator import CommTimeout, Communicator

__all__ = ["CommThread", "Handle"]

_MARGIN_S = 5.0


class Handle:
    """A submitted collective; ``wait()`` returns once it ran (raising its error, if it failed).

    Args:
        owner: the thread it runs on.
        fn: the collective.
        args: its arguments.
    """

    def __init__(self, owner: CommThread, fn: Callable[..., Any], args: tuple) -> None:
        self._owner, self._fn, self._args = owner, fn, args
        self._done = threading.Event()
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            if self._owner.error is None:
                self._fn(*self._args)
        except BaseException as e:  # handed to the waiting main thread
            self.error = self._owner.error = e
        finally:
            self._fn, self._args = None, ()  # drop the buffers: a freed array must really go
            with self._owner.lock:
                self._owner.pending -= 1
                self._owner.last_progress = time.monotonic()
            self._done.set()

    def wait(self) -> None:
        """Block until the job is done.

        Raises:
            CommTimeout: the comm thread made no progress within the timeout.
            Exception: whatever the job raised, raised again here.
        """
        owner = self._owner
        while not self._done.wait(0.05):
            stuck = time.monotonic() - owner.last_progress
            if stuck > owner.timeout + _MARGIN_S:
                raise CommTimeout(f"rank {owner.rank}: the comm thread made no progress for "
                                  f"{stuck:.0f} s; a peer is not taking part in the same "
                                  "collectives (raise DPLAB_TIMEOUT if it is only slow)")
        if owner.error is not None:
            raise owner.error


class CommThread:
    """Runs submitted collectives one after the other on a daemon thread.

    Args:
        comm: this rank's communicator (its timeout bounds a stuck job).
    """

    def __init__(self, comm: Communicator) -> None:
        self.rank, self.timeout = comm.rank, float(getattr(comm, "timeout", 60.0))
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.lock, self.pending = threading.Lock(), 0
        self._queue: queue.Queue[Handle | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dplab-zero-comm")
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Handle:
        """Queue ``fn(*args)`` behind everything submitted before it.

        Args:
            fn: a collective, e.g. ``reduce_scatter``.
            *args: its arguments.

        Returns:
            The handle to wait on.
        """
        handle = Handle(self, fn, args)
        with self.lock:
            if self.pending == 0:
                self.last_progress = time.monotonic()  # an idle thread was not a stuck one
            self.pending += 1
        self._queue.put(handle)
        return handle

    def close(self) -> None:
        """Stop the thread once the queue is done; the last call on it.

        """
        self._queue.put(None)
        self._thread.join(self.timeout + _MARGIN_S)

    def _loop(self) -> None:
        while (handle := self._queue.get()) is not None:
            handle._run()
