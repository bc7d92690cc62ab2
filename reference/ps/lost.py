"""Lost workers: telling a dead worker from a slow one, and keeping track of who will still send.

The server receives from ANY worker, and a dead worker sends nothing, ever. So it
never waits blindly: it listens in slices of ``POLL_S`` (``comm.patience``), and whenever
a slice passes in silence it asks the transport which workers are still alive
(``comm.peer_alive``). Silence with every worker alive is an error only after the
communicator's whole ``timeout``.

    roster = Roster(comm, workers=3, clocks=10)
    who = roster.listen(lambda: comm.recv(header, ANY_SOURCE, TAG_HEADER))  # None: someone died
    for worker in roster.take_dead(): ...     # the server forgets each (gate, held pulls, log line)

Limits: the shared-memory backend can tell dead from slow (a worker's pid); MPI ends the
whole job when a rank dies, and torch (gloo, NCCL) cannot tell, so there the launcher
names the dead rank and stops the world (``dplab.backends.launch.world``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from dplab.reference.communicator import CommTimeout, Communicator

__all__ = ["POLL_S", "Roster"]

POLL_S = 0.05  # seconds of silence after which the server checks that its workers are alive
T = TypeVar("T")


class Roster:
    """Which workers will still send (``active``) and which died (``lost``: worker -> clocks
    done).

    Args:
        comm: rank 0's communicator.
        workers: the number of workers.
        clocks: clocks each worker runs (0: nobody will send).
    """

    def __init__(self, comm: Communicator, workers: int, clocks: int) -> None:
        self.comm = comm
        self.active = set(range(1, workers + 1)) if clocks > 0 else set()
        self.lost: dict[int, int] = {}
        self._dead: list[int] = []  # found dead, not yet handed to the server

    def leave(self, worker: int) -> None:
        """``worker`` sends nothing more (its last clock is pushed, or it was told to stop).

        Args:
            worker: the worker.
        """
        self.active.discard(worker)

    def lose(self, worker: int, clocks_done: int) -> None:
        """``worker`` died after finishing ``clocks_done`` clocks: record it, stop waiting on it.

        Args:
            worker: the dead worker.
            clocks_done: the clocks it had finished.
        """
        self.lost[worker] = clocks_done
        self.active.discard(worker)

    def listen(self, call: Callable[[], T], peer: int | None = None) -> T | None:
        """``call()``, patiently; None if ``peer`` (for None: any worker) died meanwhile.

        Args:
            call: a blocking receive or send.
            peer: the worker it waits on, or None for any.

        Returns:
            What ``call()`` returned, or None.

        Raises:
            CommTimeout: nothing came within the communicator's timeout and nobody died.
        """
        deadline = time.monotonic() + self.comm.timeout
        while True:
            try:
                with self.comm.patience(POLL_S):
                    return call()
            except CommTimeout:
                if time.monotonic() >= deadline:
                    raise
            dead = [w for w in sorted(self.active - set(self._dead)) if not self.comm.peer_alive(w)]
            self._dead += dead
            if dead and (peer is None or peer in dead):
                return None

    def take_dead(self) -> list[int]:
        """The workers found dead since the last call, for the server to forget.

        Returns:
            The dead workers' ranks.
        """
        dead, self._dead = self._dead, []
        return dead
