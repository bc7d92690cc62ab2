"""Exercise (lesson 7): the stale-synchronous-parallel (SSP) gate of a parameter server.

A worker's clock is how many pull-compute-push rounds it has finished. Under SSP a worker may run
ahead of the slowest worker, but by at most ``staleness`` clocks: it may START clock ``clock``
only once the slowest worker has finished enough clocks. ``staleness=0`` is lock-step;
``staleness=None`` means unbounded (fully asynchronous: nobody ever waits).

Write ``may_proceed(clock, slowest, staleness)``: True if a worker may start ``clock`` now, when
the slowest worker has finished ``slowest`` clocks; False if it must wait. (The parameter server
asks this before answering a pull: dplab/reference/ps/. Don't peek at gate.py.)

The body below never makes anyone wait.

Check it (against the server's own gate, then in a real run whose server asks your gate):

    dplab lesson check 7 DIR
"""

from __future__ import annotations


def may_proceed(clock: int, slowest: int, staleness: int | None) -> bool:
    return True  # TODO: fully asynchronous whatever the staleness
