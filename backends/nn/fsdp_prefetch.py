"""FSDP's gathers ahead of need: a comm thread for the collectives, and which unit comes next.

    runner = CommRunner(threaded=True)
    job = runner.submit(flat.gather)     # on the comm thread, in submission order
    ...                                  # the main thread computes the current unit meanwhile
    job.result()                         # before the unit runs: its parameters are there

With prefetch every FSDP collective, reduce-scatters included, runs on the one comm thread in the
order the hooks submit them, the same on every rank, never two at once on one communicator:
results are bitwise those without prefetch. The next unit is the previous forward's order (the
first forward prefetches nothing), reversed for backward; a wrong guess costs memory for a while,
never correctness. Why and how it overlaps: backends/nn/README.md.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["CommRunner", "UnitOrder", "Gathers", "backward_pre"]


class _Done:
    """The handle of a job that already ran (the inline runner)."""

    def result(self) -> None:
        return None


_DONE = _Done()


class CommRunner:
    """Runs jobs in submission order: on the caller's thread, or
    (``threaded``) on one comm thread."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | _Done:
        if not self.threaded:
            fn(*args)
            return _DONE
        # one worker: FIFO, so collectives keep the order they were submitted in
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dplab-fsdp-comm")
        return self._pool.submit(fn, *args)


class UnitOrder:
    """The order units ran in: this forward's, and the previous one's to guess the next unit."""

    def __init__(self) -> None:
        self.last: list[int] = []
        self.now: list[int] = []
        self._backward_next: dict[int, int] | None = None

    def start_forward(self) -> None:
        if self.now:
            self.last = self.now
        self.now, self._backward_next = [], None

    def forward_next(self, k: int) -> int | None:
        """Record that unit k runs now; the unit that ran after it last time, if any."""
        i = len(self.now)
        self.now.append(k)
        return self.last[i + 1] if i + 1 < len(self.last) else None

    def backward_next(self, k: int) -> int | None:
        """The unit whose backward comes after unit k's: the root's first, then units in reverse."""
        if self._backward_next is None:
            seq = self.now[:1] + self.now[:0:-1]
            self._backward_next = {a: b for a, b in zip(seq, seq[1:])}
        return self._backward_next.get(k)


def backward_pre(value: Any) -> bool:
    """``backward_prefetch`` as torch spells it: None (off) or
    BACKWARD_PRE (an enum or its name)."""
    name = getattr(value, "name", value)
    if name is None:
        return False
    if name in ("BACKWARD_PRE", "backward_pre"):
        return True
    raise ConfigError("backward_prefetch must be None or 'BACKWARD_PRE' (gather the next unit "
                      f"as a unit's backward starts), got {value!r}")


class Gathers:
    """The flats' gathers, frees and reductions, each collective through one ``CommRunner``;
    gathers may run ahead (``prefetch``) and are waited for when their unit runs (``gather``).
    Trace spans, ``extra={"unit": k}``: ``unit_gather`` (on the thread that gathered) and the
    units' compute, ``unit_forward`` and ``unit_backward`` (``start``, ``end``); not ``forward``
    and ``backward``, which name a whole step's phases (a trainer's or a lesson's own spans)."""

    def __init__(self, units: list[list[Any]], runner: CommRunner, tracer: Any) -> None:
        self.units, self.runner, self.tracer = units, runner, tracer
        self._inflight: dict[Any, Future | _Done] = {}  # flat -> its gather, submitted ahead
        self._jobs: list[Future | _Done] = []  # reductions not waited for yet
        self._t0: dict[tuple[str, int], int] = {}

    def gather(self, k: int) -> None:
        """Unit k's flats gathered when this returns: waited for if
        prefetched, else gathered now."""
        for f in self.units[k]:
            job = self._inflight.pop(f, None)
            # read safely: no job of the comm thread touches f now
            if job is None and not f.gathered:
                job = self.runner.submit(self._gather, f, k)
            if job is not None:
                job.result()

    def prefetch(self, k: int | None) -> None:
        """Start gathering unit k's flats (those not gathered or on their way); returns at once."""
        for f in self.units[k] if k is not None else ():
            if f not in self._inflight and not f.gathered:
                self._inflight[f] = self.runner.submit(self._gather, f, k)

    def _gather(self, flat: Any, k: int) -> None:
        with self.tracer.span("unit_gather", bytes=flat.leaf_bytes, extra={"unit": k}):
            flat.gather()

    def free(self, flat: Any) -> None:
        job = self._inflight.pop(flat, None)
        # a guess that came in while the unit ran: wait, then free with the rest
        if job is not None:
            job.result()
        flat.free()

    def reduce(self, flat: Any, weight: float | None) -> None:
        """Submit the flat's reduce-scatter; ``drain`` waits for it."""
        self._jobs.append(self.runner.submit(flat.reduce_grad, weight))

    def drain(self) -> None:
        """Wait for every submitted job; the first error, if any, is raised after all have ended."""
        jobs = self._jobs + list(self._inflight.values())
        self._jobs, self._inflight = [], {}
        errors = []
        for job in jobs:
            try:
                job.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every job has ended
                errors.append(e)
        if errors:
            raise errors[0]

    def start(self, phase: str, k: int) -> None:
        if self.tracer.enabled:
            self._t0[(phase, k)] = self.tracer.now()

    def end(self, phase: str, k: int) -> None:
        t0 = self._t0.pop((phase, k), None)
        if t0 is not None:
            self.tracer.record(f"unit_{phase}", t0, self.tracer.now(), extra={"unit": k})
