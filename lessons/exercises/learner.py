"""The learner's file, run safely: load it by path, call it, and turn whatever goes wrong into words.

    fn = load_function(Path("work/ring_reduce_scatter.py"), "ring_reduce_scatter")
    with learner_call(file, "ring_reduce_scatter"):
        schedule = fn(4)                        # an exception here becomes a Fail naming the line

A checker raises ``Fail(message)`` for anything the learner should fix; ``judged`` turns that into
an ``ExerciseReport``. Nothing the learner writes may crash ``dplab lesson check``: an exception in
their code, a syntax error, a missing function, a rank that raised all become a report that names
the line of their file it happened on.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplab.reference.errors import DplabError

__all__ = ["ExerciseReport", "Fail", "TooLong", "CALL_LIMIT_S", "load_function", "learner_call", "describe",
           "describe_rank_error", "judged"]

_counter = itertools.count()


@dataclass(frozen=True)
class ExerciseReport:
    """One exercise's verdict: ``message`` says what is wrong in the lesson's words, or what was proven."""

    name: str
    passed: bool
    message: str


class Fail(DplabError):
    """The learner's answer is wrong (or does not run): the message is what the learner reads."""


def load_function(file: Path, name: str) -> Callable[..., Any]:
    """Import ``file`` under a fresh module name (so an edited file is read again) and return ``name``."""
    file = Path(file)
    if not file.is_file():
        raise Fail(f"there is no {file.name} in {file.parent}: run `dplab lesson init {file.parent}` to get "
                   f"the stubs, then write your answer in {file.name}")
    module_name = f"_dplab_exercise_{file.stem}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise Fail(f"{file} cannot be imported as Python: it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        code = (e.text or "").strip()
        raise Fail(f"{file.name} is not valid Python: {e.msg} at line {e.lineno}"
                   + (f": `{code}`" if code else "")) from None
    except Exception as e:  # what runs at import is the learner's code too
        raise Fail(describe(e, file, f"importing {file.name}")) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise Fail(f"{file.name} defines no function {name}: keep the stub's name and signature")
    return fn


CALL_LIMIT_S = 30.0  # one call of the learner's function; the checkers' own calls take milliseconds


class TooLong(Exception):
    """The learner's function ran past ``CALL_LIMIT_S``: a loop that never ends, most likely."""


@contextmanager
def learner_call(file: Path, what: str) -> Iterator[None]:
    """Around a call of the learner's function: any exception becomes a ``Fail`` naming their line,
    and a call that runs past ``CALL_LIMIT_S`` is stopped (SIGALRM, in the main thread) and named
    at the line it was running, instead of hanging ``dplab lesson check``."""
    with _time_limit(CALL_LIMIT_S):
        try:
            yield
        except Fail:
            raise
        except Exception as e:
            raise Fail(describe(e, file, what)) from None


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield  # no timer off the main thread: the call runs unguarded
        return

    def stop(signum: int, frame: Any) -> None:
        raise TooLong(f"still running after {seconds:g} s: does a loop never end?")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def describe(exc: BaseException, file: Path, what: str) -> str:
    """``"ring_reduce_scatter raised ValueError: ... (line 31 of ring_reduce_scatter.py: `code`)"``."""
    text = f"{what} raised {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if _same(f.filename, file)]
    if mine:
        text += f" (line {mine[-1].lineno} of {Path(file).name}" + (f": `{mine[-1].line.strip()}`)"
                                                                      if mine[-1].line else ")")
    return text


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<code>[^\n]*)')


def describe_rank_error(detail: str, rank: int, file: Path, what: str) -> str:
    """The same sentence from a rank's traceback text (a ``RankError``'s ``detail``)."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "an error without a message"
    last = re.sub(r"^[\w.]+\.(\w+):", r"\1:", last)  # dplab.reference.errors.ConfigError: -> ConfigError:
    text = f"{what} raised on rank {rank}: {last}"
    mine = [m for m in _FRAME.finditer(detail) if _same(m["file"], file)]
    if mine:
        code = mine[-1]["code"].strip()
        text += f" (line {mine[-1]['line']} of {Path(file).name}" + (f": `{code}`)" if code else ")")
    return text


def _same(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def judged(name: str, judge: Callable[[Path], str]) -> Callable[[Path], ExerciseReport]:
    """``judge(file)`` returns what a right answer proved, or raises ``Fail``: as a report, always."""

    def checker(file: Path) -> ExerciseReport:
        try:
            return ExerciseReport(name, True, judge(Path(file)))
        except Fail as e:
            return ExerciseReport(name, False, str(e))
        except Exception as e:  # the learner's answer broke the checker itself: still a report
            return ExerciseReport(name, False, describe(e, Path(file), f"checking {Path(file).name}")
                                  + " (the checker could not judge this answer: report it if it looks right)")

    checker.__name__ = f"check_{name}"
    checker.__doc__ = judge.__doc__
    return checker
