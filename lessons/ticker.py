"""A progress bar for one step's run, shown only once the run has taken more than a second.

    with Ticker(console, "running step 1: One model, four replicas", expected_s=2.4):
        outcome = run_step(step, lab)

The step runs in this thread; a timer thread starts a transient rich progress bar after
``DELAY_S``, so quick steps print nothing. With ``expected_s`` (the time
the step took here last time) the bar fills over that time and shows an ETA; without, it pulses.
Nothing is drawn unless the console is a terminal. The timer (and rich's refresh thread, which
inherits its mask) blocks SIGINT and SIGTERM: Ctrl-C must interrupt the main thread's run or
``input()``, and a signal the kernel hands to another thread would leave that call blocked.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import rich.progress as rp
from rich.console import Console

__all__ = ["Ticker", "DELAY_S"]

DELAY_S = 1.0
_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _Clock(rp.Progress):
    """A progress whose completion is the time elapsed: ``expected_s`` is the whole bar."""

    def get_renderables(self) -> Any:
        for task in self.tasks:
            if task.total:
                self.update(task.id, completed=min(task.elapsed or 0.0, 0.99 * task.total))
        yield self.make_tasks_table(self.tasks)


class Ticker:
    def __init__(self, console: Console, label: str, expected_s: float | None = None,
                 delay_s: float = DELAY_S) -> None:
        self.console, self.label, self.expected_s, self.delay_s = (
            console,
            label,
            expected_s,
            delay_s,
        )
        self._lock = threading.Lock()
        self._done = False
        self._bar: _Clock | None = None
        self._timer: threading.Timer | None = None
        self.started_at = 0.0

    def __enter__(self) -> Ticker:
        self.started_at = time.perf_counter()
        if self.console.is_terminal:
            self._timer = threading.Timer(self.delay_s, self._start)
            self._timer.daemon = True
            # the timer inherits the mask
            saved = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
            try:
                self._timer.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        return self

    def _start(self) -> None:
        with self._lock:
            if self._done:
                return
            label = self.label if len(self.label) <= 40 else self.label[:39] + "…"
            self._bar = _Clock(
                rp.SpinnerColumn(),
                rp.TextColumn(label),
                rp.BarColumn(bar_width=20),
                rp.TimeElapsedColumn(),
                rp.TextColumn("eta" if self.expected_s else ""),
                *([rp.TimeRemainingColumn()] if self.expected_s else []),
                console=self.console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
                refresh_per_second=8,
            )
            total = max(self.expected_s, 0.1) if self.expected_s else None
            task = self._bar.add_task(self.label, total=total)
            # the clock starts with the run, not with the bar a second later
            self._bar.tasks[task].start_time -= time.perf_counter() - self.started_at
            self._bar.start()

    @property
    def shown(self) -> bool:
        """Whether the bar appeared (the run outlasted the delay on a terminal)."""
        return self._bar is not None

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                self._bar.stop()
