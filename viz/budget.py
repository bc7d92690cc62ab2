"""One budget of ranks and seconds for everything an app server runs, whoever asks.

    from dplab.viz.budget import BUDGET, visitor_hooks
    stop, check = visitor_hooks()                    # the running page's "has its visitor gone?"
    with BUDGET.world(4, stop=stop, check=check) as world:
        world.run(fn)                                # at most BUDGET.limits.ranks ranks at once

* ranks: a run waits, first come first served, until its ranks fit in ``Limits.ranks`` (the
  cores this process may use); a run larger than that waits for the whole budget and runs alone;
* waiting: at most ``Limits.queue`` runs wait, each at most ``Limits.wait_s`` (``Busy``, one line);
* time: a world lives at most ``Limits.run_s`` seconds, then its ranks are killed (``Stopped``);
* leaving: a watchdog kills the ranks as soon as the page's script is asked to stop.

A visitor whose runs hold several worlds at once (a lesson's ``Lab``: a world of 1 beside a world
of 2) opens them through one ``Lease``: ``Lab(open_world=BUDGET.lease().world)``. A lease never
waits while it holds ranks (to open one more world it gives its ranks back and asks for the
total), so two visitors who each hold some can never wait for each other, nor a visitor for itself.

Why a budget: viz/README.md. Pure threading: Streamlit is imported only by ``visitor_hooks``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dplab.backends.launch.world import World
from dplab.reference.errors import DplabError

__all__ = ["Limits", "Budget", "Lease", "Busy", "Stopped", "BUDGET", "cores", "visitor_hooks"]


def cores() -> int:
    """The CPU cores this process (and the ranks it forks) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Limits:
    """What all of the server's visitors together may run at once."""

    ranks: int = field(default_factory=cores)  # ranks running at once
    run_s: float = 60.0  # one world's life, start to close
    wait_s: float = 120.0  # the longest a run waits for its turn
    queue: int = 16  # runs waiting at once; one more is refused


class Busy(DplabError):
    """The server's budget has no room for this run now."""


class Stopped(DplabError):
    """A run was killed: it ran past its time, or its visitor left."""


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


def visitor_hooks() -> tuple[Callable[[], bool], Callable[[], None]]:
    """``(stop, check)`` for the page running in this thread: ``stop()`` (any thread) is True once
    Streamlit has asked the script to stop or rerun (its visitor left or changed a control);
    ``check()`` (this thread) raises Streamlit's own stop or rerun. Outside a page:
    never, nothing."""
    try:
        from streamlit.runtime.scriptrunner import get_script_run_ctx
    except ImportError:
        return _never, _nothing
    ctx = get_script_run_ctx(suppress_warning=True)
    requests = getattr(ctx, "script_requests", None)
    if ctx is None or requests is None:
        return _never, _nothing

    def stop() -> bool:
        # ScriptRequestType: CONTINUE until a stop or rerun
        state = getattr(requests, "_state", None)
        return getattr(state, "name", "CONTINUE") != "CONTINUE"

    return stop, getattr(ctx, "yield_check", _nothing)


class _Watchdog(threading.Thread):
    """Kills ``world``'s ranks when ``stop()`` turns True or ``deadline`` passes."""

    def __init__(self, world: World, stop: Callable[[], bool], deadline: float) -> None:
        super().__init__(name="dplab-app-watchdog", daemon=True)
        self.world, self.stop, self.deadline = world, stop, deadline
        self.done, self.reason = threading.Event(), ""

    def run(self) -> None:
        while not self.done.wait(0.1):
            left, stopped = time.monotonic() >= self.deadline, self.stop()
            if left or stopped:
                self.reason = "left" if stopped else "time"
                self.world.abort()
                return


class Budget:
    """Ranks for every run of this process, first come first served (see the module)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._cond = threading.Condition()
        self._free = self.limits.ranks
        self._queue: deque[object] = deque()

    def state(self) -> tuple[int, int]:
        """(ranks running now, runs waiting)."""
        with self._cond:
            return self.limits.ranks - self._free, len(self._queue)

    def waiting_line(self, world_size: int) -> str | None:
        """What a visitor reads while a run of ``world_size`` ranks waits;
        None when it would start now."""
        running, waiting = self.state()
        if not waiting and self.limits.ranks - running >= min(world_size, self.limits.ranks):
            return None
        return (f"Queued: this server runs {running} ranks for other visitors and {waiting} run"
                f"{'s' * (waiting != 1)} wait; yours ({world_size} ranks) starts when its turn "
                f"comes (at most {self.limits.wait_s:g} s).")

    def acquire(self, world_size: int, stop: Callable[[], bool] = _never) -> int:
        """Wait for ``world_size`` ranks (all of them, if it is more);
        returns how many to release."""
        need = min(world_size, self.limits.ranks)
        ticket, deadline = object(), time.monotonic() + self.limits.wait_s
        with self._cond:
            if len(self._queue) >= self.limits.queue:
                raise Busy(f"the server is busy: {len(self._queue)} runs wait already; try again "
                           "in a minute")
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._free >= need):
                    if stop():
                        raise Stopped("stopped before it started: the page was left or changed")
                    if time.monotonic() >= deadline:
                        raise Busy(f"the server is busy: waited {self.limits.wait_s:g} s for "
                                   f"{need} ranks behind other visitors' runs; "
                                   "try again in a minute")
                    self._cond.wait(0.1)
                self._free -= need
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
        return need

    def release(self, held: int) -> None:
        with self._cond:
            self._free += held
            self._cond.notify_all()

    def world(self, world_size: int, backend: str = "local", tolerate: frozenset[int] = frozenset(),
              stop: Callable[[], bool] = _never, check: Callable[[], None] = _nothing,
              cluster: str | None = None) -> _Held:
        """A ``World`` under this budget: waits its turn, and is killed past ``Limits.run_s`` or
        once ``stop()`` (``visitor_hooks``); then ``check()`` ends the page, else ``Stopped`` says
        why. ``cluster``: backend "sim"'s simulated cluster."""
        return _Held(self, world_size, backend, tolerate, stop, check, cluster)

    def lease(self) -> Lease:
        """Ranks for several worlds open at once, for one visitor (see the module)."""
        return Lease(self)


class Lease:
    """The ranks of one visitor's open worlds, held as one amount: ``min(their ranks,
    Limits.ranks)``.

    ``lease.world(p, backend)`` is ``Budget.world`` for the page running in the calling thread
    (its ``visitor_hooks``), counted with the lease's other open worlds. Growing gives every rank
    back first and asks for the total: a lease never waits while it holds ranks."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.held = 0  # ranks taken from the budget
        self.open = 0  # ranks of the lease's open worlds
        self._lock = threading.Lock()

    def world(self, world_size: int, backend: str = "local", cluster: str | None = None) -> _Held:
        stop, check = visitor_hooks()
        return _Held(
            self.budget, world_size, backend, frozenset(), stop, check, cluster, lease=self
        )

    def grow(self, world_size: int, stop: Callable[[], bool]) -> None:
        """Hold enough ranks for one more open world of ``world_size``."""
        with self._lock:
            need = min(self.open + world_size, self.budget.limits.ranks)
            if need > self.held:
                self.budget.release(self.held)
                self.held = 0
                self.held = self.budget.acquire(need, stop)
            self.open += world_size

    def shrink(self, world_size: int) -> None:
        """A world of ``world_size`` closed: give back what the others no longer need."""
        with self._lock:
            self.open -= world_size
            keep = min(self.open, self.budget.limits.ranks)
            if keep < self.held:
                self.budget.release(self.held - keep)
                self.held = keep


class _Held:
    """``with budget.world(p) as world``: the ranks are released and the world closed on the way
    out."""

    def __init__(self, budget: Budget, world_size: int, backend: str, tolerate: frozenset[int],
                 stop: Callable[[], bool], check: Callable[[], None],
                 cluster: str | None = None, lease: Lease | None = None) -> None:
        self.budget, self.args, self.lease = budget, (world_size, backend, tolerate), lease
        self.cluster = cluster
        self.stop, self.check = stop, check
        self.held, self.world, self.dog = 0, None, None

    def _take(self) -> None:
        if self.lease is not None:
            self.lease.grow(self.args[0], self.stop)
        else:
            self.held = self.budget.acquire(self.args[0], self.stop)

    def _give_back(self) -> None:
        if self.lease is not None:
            self.lease.shrink(self.args[0])
        else:
            self.budget.release(self.held)

    def __enter__(self) -> World:
        world_size, backend, tolerate = self.args
        try:
            self._take()
        except Stopped:
            self.check()
            raise
        try:
            self.world = World(world_size, backend, tolerate=tolerate, cluster=self.cluster)
        except BaseException:
            self._give_back()
            raise
        self.dog = _Watchdog(self.world, self.stop, time.monotonic() + self.budget.limits.run_s)
        self.dog.start()
        return self.world

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        self.dog.done.set()
        self.dog.join()
        try:
            if exc_type is None and not self.dog.reason:
                self.world.close()
            else:
                self.world.abort()
        finally:
            self._give_back()
        if self.dog.reason == "left":
            self.check()  # Streamlit's own stop or rerun: the page ends quietly
            raise Stopped("stopped: the page was left or changed while it ran") from None
        if self.dog.reason == "time":
            raise Stopped(f"stopped after {self.budget.limits.run_s:g} s, this app's limit for one "
                          "run: ask for less (fewer steps, sizes or ranks), or run it with dplab "
                          "on the command line") from None
        return False


BUDGET = Budget()  # the one budget of this server process: every page's runs go through it
