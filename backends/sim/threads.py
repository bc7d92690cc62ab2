"""The threads and clocks of a simulated world's process, on virtual time.

The ranks' own code starts threads (the bucket reducer's comm thread, FSDP's prefetch pool, ZeRO's
comm thread) and hands work between them through queues, semaphores, events and futures; it reads
clocks (``time.perf_counter``) and sleeps (a straggler's slowdown). ``install`` makes all of that
run on the simulation, in the forked process that holds the sim world's ranks and nowhere else (as
SimGrid's SMPI runs unmodified MPI programs on a simulated platform):

- a thread that a rank's thread starts is an actor of that rank (``engine.spawn``), ready at its
  parent's time, and ``join`` waits for it in virtual time;
- a wait on a ``threading.Condition`` (under every Queue, Semaphore, Event and Future) by an actor
  gives the baton away until another actor notifies it, which wakes it at the notifier's time; a
  timeout is virtual time too; ``queue.SimpleQueue`` (C code, no Condition) becomes a Queue;
- ``time.perf_counter``, ``perf_counter_ns`` and ``process_time`` read the actor's virtual clock
  (its compute so far spent first, queued on its device), and ``time.sleep`` spends virtual time:
  the host's load never reaches a simulated time.

Outside an actor (the launcher's pipes, the watchdog thread) everything behaves as it always does.
"""

from __future__ import annotations

import queue
import threading
import time
from _thread import allocate_lock
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dplab.backends.sim.engine import Engine, SimError

__all__ = ["install", "engine"]

_ENGINE: Engine | None = None
_SIM_WAITERS: dict[Any, Any] = {}  # a Condition's waiter lock -> the actor blocked on it
_THREAD_ACTORS: dict[threading.Thread, Any] = {}
_PLAIN = threading.local()  # depth > 0: this thread's waits are real ones (Thread.start's own)
_ORIGINAL: dict[str, Any] = {}
_INSTALL = threading.Lock()  # every rank thread installs; the first one does it


def engine() -> Engine | None:
    """The engine of this process's simulated world, once ``install`` ran."""
    return _ENGINE


def _actor() -> Any:
    if _ENGINE is None or getattr(_PLAIN, "depth", 0):
        return None
    actor = _ENGINE.current()
    if actor is not None:
        _ENGINE.contact(actor)  # e.g. torch was imported since the job began: price its operations
    return actor


@contextmanager
def _plain() -> Iterator[None]:
    _PLAIN.depth = getattr(_PLAIN, "depth", 0) + 1
    try:
        yield
    finally:
        _PLAIN.depth -= 1


class SimCondition(threading.Condition):
    """A Condition whose waits by an actor are waits in virtual time (see the module docstring)."""

    def wait(self, timeout: float | None = None) -> bool:
        actor = _actor()
        if actor is None:
            return super().wait(timeout)
        if not self._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        if timeout is not None and timeout <= 0:
            return False
        waiter = allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        _SIM_WAITERS[waiter] = actor
        saved = self._release_save()
        try:
            if timeout is not None:
                _ENGINE.timer(actor, _ENGINE.later(actor) + timeout)
            _ENGINE.flush(actor)  # its compute so far goes on its device; a notify waits for it
            _ENGINE.block(actor, "another thread of its rank (a queue, lock or event)")
        finally:
            _SIM_WAITERS.pop(waiter, None)
            notified = waiter not in self._waiters
            if not notified:
                self._waiters.remove(waiter)
            self._acquire_restore(saved)
        return notified

    def notify(self, n: int = 1) -> None:
        if _ENGINE is not None and _ENGINE.failed is None:
            woken = [_SIM_WAITERS.get(w) for w in list(self._waiters)[:n]]
            if any(a is not None for a in woken):
                me = _ENGINE.current()
                if me is None:
                    raise SimError("a thread outside the simulation woke one of its ranks' threads")
                for a in woken:  # at the notifier's time, after its compute; no baton handed over
                    if a is not None:  # here: notify runs under the condition's lock
                        _ENGINE.wake(a, _ENGINE.later(me))
        super().notify(n)


class SimpleQueue(queue.Queue):
    """``queue.SimpleQueue``'s interface on a Queue (whose waits are SimCondition's)."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item)

    def put_nowait(self, item: Any) -> None:
        super().put(item)


def _start(self: threading.Thread) -> None:
    parent = _actor()
    if parent is None:
        return _ORIGINAL["start"](self)
    child = _ENGINE.spawn(parent, self.name)
    _THREAD_ACTORS[self] = child
    run, eng = self.run, _ENGINE

    def run_simulated() -> None:
        eng.attach(child)
        try:
            eng._wait_baton(child)
        except SimError:
            return  # the world failed before this thread ran: nothing to do
        try:
            run()
        finally:
            eng.finish(child)

    self.run = run_simulated  # type: ignore[method-assign]
    with _plain():  # Thread.start waits for the new thread to say it started: a real wait
        _ORIGINAL["start"](self)


def _join(self: threading.Thread, timeout: float | None = None) -> None:
    actor, child = _actor(), _THREAD_ACTORS.get(self)
    if actor is not None and child is not None:
        _ENGINE.join(actor, child)
    with _plain():
        _ORIGINAL["join"](self, timeout)


def _clock() -> Any:
    """The calling actor with its compute spent (queued on its device, as a clock read would see
    it), or None outside the simulation."""
    actor = _actor()
    if actor is not None:
        _ENGINE.settle(actor)
    return actor


def _perf_counter() -> float:
    actor = _clock()
    return _ORIGINAL["perf_counter"]() if actor is None else actor.time


def _perf_counter_ns() -> int:
    actor = _clock()
    return _ORIGINAL["perf_counter_ns"]() if actor is None else round(actor.time * 1e9)


def _process_time() -> float:
    actor = _clock()
    return _ORIGINAL["process_time"]() if actor is None else actor.time


def _sleep(seconds: float) -> None:
    actor = _actor()
    if actor is None:
        _ORIGINAL["sleep"](seconds)
    else:
        _ENGINE.advance(actor, seconds)


def install(eng: Engine) -> None:
    """Put this process's threads and clocks on ``eng`` (once; only in the sim world's process)."""
    global _ENGINE
    with _INSTALL:
        if _ENGINE is eng:
            return
        if _ENGINE is not None:
            raise SimError("this process already runs another simulated world")
        _patch(eng)


def _patch(eng: Engine) -> None:
    global _ENGINE
    _ENGINE = eng
    _ORIGINAL.update(
        start=threading.Thread.start,
        join=threading.Thread.join,
        perf_counter=time.perf_counter,
        perf_counter_ns=time.perf_counter_ns,
        process_time=time.process_time,
        sleep=time.sleep,
    )
    threading.Condition = SimCondition  # type: ignore[misc]
    queue.SimpleQueue = SimpleQueue  # type: ignore[misc]
    threading.Thread.start = _start  # type: ignore[method-assign]
    threading.Thread.join = _join  # type: ignore[method-assign]
    time.perf_counter, time.perf_counter_ns = _perf_counter, _perf_counter_ns
    time.process_time, time.sleep = _process_time, _sleep
