"""Run a lesson's steps on the real engine: the one path the terminal, the app and CI share.

    from dplab.lessons import lesson
    from dplab.lessons.runner import Lab, run_step

    with Lab() as lab:
        for step in lesson(1).steps:
            out = run_step(step, lab)
            print(out.text, [c.holds for c in out.checks])

A ``Lab`` keeps one world of ranks per (world size, backend) alive between steps (starting
ranks is the slow part), and closes them at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dplab.backends import World
from dplab.backends.launch.serve import one_thread_per_rank
from dplab.lessons.capture import capturing, stderr_to
from dplab.lessons.printable import printable
from dplab.lessons.step import Facts, Lesson, Step, fill
from dplab.reference.errors import ConfigError, DplabError

__all__ = ["Lab", "CheckResult", "StepOutcome", "run_step", "missing_needs", "LessonCheckFailed"]

# the modules each extra brings (found, not imported: fast)
_EXTRA_MODULES = {"mpi": ("mpi4py",), "torch": ("torch",), "viz": ("plotly", "streamlit")}


class LessonCheckFailed(DplabError):
    """A step's claim did not hold on this run: the lesson and the engine disagree."""


def missing_needs(lesson: Lesson) -> list[str]:
    """The extras ``lesson`` needs that are not installed, e.g. ``["mpi"]``."""
    missing = []
    for extra in lesson.needs:
        if extra not in _EXTRA_MODULES:
            raise ConfigError(f"lesson {lesson.number} needs unknown extra {extra!r}: use one of "
                              f"{', '.join(_EXTRA_MODULES)}")
        if any(importlib.util.find_spec(m) is None for m in _EXTRA_MODULES[extra]):
            missing.append(extra)
    return missing


OpenWorld = Callable[[int, str], AbstractContextManager[World]]  # (world_size, backend) -> a world


class Lab:
    """The ranks a lesson's steps run on, kept between steps.

    Args:
        open_world: how a world is opened, ``open_world(world_size, backend)`` -> a context
            manager of a ``World``; None: ``World`` itself. The app passes its rank budget's
            (``dplab.viz.budget``), so lesson runs wait their turn with every other run.
    """

    def __init__(self, open_world: OpenWorld | None = None) -> None:
        # A step's own NumPy work shares the cores with the ranks it starts:
        # one BLAS thread, as each rank has (two OpenBLAS threads against busy ranks made lesson
        # 10's matmuls many times slower).
        one_thread_per_rank()
        self._open = open_world or World
        self._worlds: dict[tuple[int, str], World] = {}
        self._held = contextlib.ExitStack()    # the open worlds' contexts, closed by close()
        self.scratch: dict[str, Any] = {}  # what one step leaves for the next (a checkpoint path)
        # What the ranks write to stderr (a server's warning) lands in a file of the lab's, not on
        # the learner's screen above the question: each rank points its own fd 2 there (capture.py),
        # and what a step writes to sys.stderr goes there too; ``stderr_since`` reads it.
        self._dir: tempfile.TemporaryDirectory | None = None  # made at first use and after close()
        self._read = 0

    def _path(self) -> Path:
        if self._dir is None:
            self._dir, self._read = tempfile.TemporaryDirectory(prefix="dplab-lab-"), 0
            (Path(self._dir.name) / "stderr").touch()
        return Path(self._dir.name) / "stderr"

    @contextlib.contextmanager
    def capturing_stderr(self) -> Iterator[None]:
        """What this thread writes to ``sys.stderr`` while the body runs goes to the lab's file
        (the process's own stderr, and other threads' writes, are left alone)."""
        with open(self._path(), "a", encoding="utf-8", errors="replace") as err:
            with capturing(stderr=err):
                yield

    def stderr_since(self) -> str:
        """What was written to the lab's stderr file since the last call."""
        with open(self._path(), "rb") as file:
            file.seek(self._read)
            data = file.read()
        self._read += len(data)
        return data.decode("utf-8", "replace")

    def world(self, world_size: int, backend: str = "local") -> World:
        key = (world_size, backend)
        if key not in self._worlds:
            with self.capturing_stderr():
                world = self._held.enter_context(self._open(world_size, backend))
                world.run(stderr_to, str(self._path()))
            self._worlds[key] = world
        return self._worlds[key]

    def close(self) -> None:
        """Close the worlds (giving their ranks back) and the stderr file; the lab can run again."""
        held, self._held = self._held, contextlib.ExitStack()
        self._worlds.clear()
        try:
            held.close()
        finally:
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class CheckResult:
    claim: str                                 # filled
    holds: bool


@dataclass(frozen=True)
class StepOutcome:
    step: Step
    facts: Facts
    text: str                                  # filled
    checks: tuple[CheckResult, ...]
    seconds: float
    figure: Any = field(default=None)          # the plotly figure, when the step has one
    # what the run printed: shown with the result, never before
    printed: str = ""

    @property
    def ok(self) -> bool:
        return all(c.holds for c in self.checks)

    def question(self) -> str | None:
        return fill(self.step.predict.question, self.facts) if self.step.predict else None

    def raise_if_failed(self) -> None:
        failed = [c.claim for c in self.checks if not c.holds]
        if failed:
            raise LessonCheckFailed(f"step {self.step.title!r}: {'; '.join(failed)} did not hold "
                                    f"(facts: {_short(self.facts)})")


def run_step(step: Step, lab: Lab, figure: bool = True) -> StepOutcome:
    """Run ``step`` on ``lab``'s ranks; fill its text and judge its checks (never raises for a
    failed check: the caller shows it, CI raises with ``raise_if_failed``). The facts are the
    step's ``inputs`` and what the run returned; a run that contradicts an input is a ConfigError
    (the question asked before the run would have lied). What the run prints is kept in ``printed``
    (it may hold the answer, and a question can be asked after the run), and so is what the run and
    its ranks write to stderr (a parameter server's warning), never printed above the question."""
    t0 = time.perf_counter()
    try:
        printed = io.StringIO()
        with capturing(stdout=printed), lab.capturing_stderr():  # this session's thread only
            ran = step.run(lab)
    except BaseException:
        # a failed step's ranks said why: not kept from the reader
        sys.stderr.write(lab.stderr_since())
        raise
    # stdout and stderr alike, shown with the result, as text: no escape sequence acts on the screen
    said = printable(printed.getvalue() + lab.stderr_since())
    if not isinstance(ran, dict):
        raise ConfigError(f"step {step.title!r}: run() must return a dict of facts, "
                          f"got {type(ran).__name__}")
    seconds = time.perf_counter() - t0
    differ = [k for k in step.inputs if k in ran and not _same(ran[k], step.inputs[k])]
    if differ:
        raise ConfigError(f"step {step.title!r}: the run's "
                          f"{', '.join(f'{k}={ran[k]!r}' for k in differ)} "
                          f"contradict{'s' if len(differ) == 1 else ''} the step's inputs "
                          f"({', '.join(f'{k}={step.inputs[k]!r}' for k in differ)})")
    facts = {**step.inputs, **ran}
    checks = tuple(CheckResult(fill(c.claim, facts), bool(c.holds(facts))) for c in step.checks)
    fig = step.figure(facts) if (figure and step.figure is not None) else None
    return StepOutcome(step, facts, fill(step.text, facts), checks, seconds, fig, said)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays: compared by value, never truth-tested
        return False


def _short(facts: Facts) -> str:
    return ", ".join(
        f"{k}={v!r}"[:60] for k, v in facts.items() if isinstance(v, (int, float, str, bool))
    )
