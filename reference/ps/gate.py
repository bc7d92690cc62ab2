"""The stale-synchronous-parallel (SSP) gate: may a worker start clock c yet?

A worker's CLOCK is its count of finished pull-compute-push rounds. The gate lets a
pull for clock c through once the slowest live worker has finished c - s clocks
(s = ``AsyncConfig.staleness``, counted in clocks):

    done = [3, 1, 2]      (clocks finished by workers 1, 2, 3),   s = 1
    pull for clock 2:     min(done) = 1 >= 2 - 1   -> answered now
    pull for clock 3:     min(done) = 1 <  3 - 1   -> held until worker 2 pushes clock 1

s = 0 is lock-step, s = None never holds anyone (fully asynchronous). A worker that died
is forgotten: only the LIVE workers' clocks count, so nobody waits for the dead.

    >>> gate = Gate(workers=3, staleness=1)
    >>> gate.finish(1, 0); gate.opens(1), gate.opens(2)
    (True, False)
"""

from __future__ import annotations

__all__ = ["gate_open", "Gate"]


def gate_open(done: list[int], clock: int, staleness: int | None) -> bool:
    """SSP: a worker may start ``clock`` once the slowest has finished ``clock - staleness`` clocks.

    ``done``: the LIVE workers' finished clocks; a lost worker no longer holds anyone back.

    Args:
        done: the live workers' finished clocks.
        clock: the clock a worker asks to start.
        staleness: the bound, or None for none.

    Returns:
        True if the worker may start it now.
    """
    return staleness is None or not done or min(done) >= clock - staleness


class Gate:
    """Each worker's finished clocks, and the SSP rule over the live ones.

    Args:
        workers: the number of workers.
        staleness: the bound, or None for none.
    """

    def __init__(self, workers: int, staleness: int | None) -> None:
        self.staleness = staleness
        self.done = [0] * workers  # per worker 1..W (index w - 1): clocks finished
        self.gone: set[int] = set()  # lost workers: they hold nobody back any more

    def finish(self, worker: int, clock: int) -> None:
        """``worker`` pushed ``clock``: it has finished clock + 1 clocks.

        Args:
            worker: the worker.
            clock: the clock it pushed.
        """
        self.done[worker - 1] = clock + 1

    def forget(self, worker: int) -> int:
        """A dead worker leaves the gate; returns the clocks it had finished.

        Args:
            worker: the dead worker.

        Returns:
            How many clocks it had finished.
        """
        self.gone.add(worker)
        return self.done[worker - 1]

    def live(self) -> list[int]:
        """The finished clocks of the workers still alive.

        Returns:
            One count per live worker, in worker order.
        """
        return [d for w, d in enumerate(self.done, 1) if w not in self.gone]

    def slowest(self, default: int) -> int:
        """The live workers' fewest finished clocks (``default`` if none is alive).

        Args:
            default: the answer when no worker is alive.

        Returns:
            The fewest clocks any live worker has finished.
        """
        return min(self.live(), default=default)

    def opens(self, clock: int) -> bool:
        """Whether a pull for ``clock`` may be answered now (``gate_open`` over the live workers).

        Args:
            clock: the clock asked for.

        Returns:
            True if the slowest live worker is close enough behind.
        """
        return gate_open(self.live(), clock, self.staleness)

    def next_clock(self, worker: int, asked: int) -> int:
        """The clock a pull gets: the one asked for, or after a resume the worker's next unfinished
        one.

        Args:
            worker: the worker.
            asked: the clock it asked for.

        Returns:
            The clock to hand it.
        """
        return max(asked, self.done[worker - 1])
