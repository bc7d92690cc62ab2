"""The learner's file: load it by path, call it, and turn whatever goes wrong into one line.

This module runs on both sides of ``dplab lesson check``. In the child process
(``lessons/exercises/child.py``) it loads the learner's file and calls their function::

    fn = load_function(Path("work/ring_reduce_scatter.py"), "ring_reduce_scatter")
    with learner_call(file, "ring_reduce_scatter(4)"):
        schedule = fn(4)                        # an exception here becomes a Fail naming the line

In the parent it judges what came back: a checker raises ``Fail(message)`` for anything the
learner should fix, and ``judged`` turns that into an ``ExerciseReport``. Nothing the learner
writes may crash ``dplab lesson check``: an exception, a syntax error, a missing function, a rank
that raised, a ``sys.exit``, a fork all become a report that names the line of their file. A
check that cannot run on this machine at all (a full /dev/shm) is a ``CheckUnavailable``: a
one-line error about the machine, never a verdict on the answer.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import reprlib
import resource
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplab.lessons.printable import printable
from dplab.reference.errors import ConfigError, DplabError

__all__ = ["ExerciseReport", "Fail", "CheckUnavailable", "TooLong", "LIMIT_S", "MESSAGE_CHARS",
           "limit_s", "load_function", "learner_call", "same_process", "describe",
           "describe_rank_error", "rank_failure", "clip", "short_repr", "judged"]

_counter = itertools.count()

# the learner's code in one check (import and every call): the checkers' own take ~1 s
LIMIT_S = 30.0
MESSAGE_CHARS = 600  # what a report quotes of an exception's message or a returned value


def limit_s() -> float:
    """The time limit of one check: ``$DPLAB_CHECK_LIMIT_S`` when set (tests use a short one), else
    ``LIMIT_S`` stretched by how busy the machine is now (``busy``): a right answer must not be
    judged a loop that never ends because other work had the cores."""
    text = os.environ.get("DPLAB_CHECK_LIMIT_S", "")
    try:
        value = float(text) if text else float(round(LIMIT_S * busy()))
    except ValueError:
        raise ConfigError(f"DPLAB_CHECK_LIMIT_S={text!r} is not a number of seconds: unset it or "
                          "give e.g. 30") from None
    if not 0 < value < 1e6:
        raise ConfigError(f"DPLAB_CHECK_LIMIT_S={text!r} must be a positive number of seconds, "
                          "e.g. 30")
    return value


def busy() -> float:
    """How many times slower than on idle cores a check may run now: the 1-minute load average
    over the cores this process may use, at least 1 (at most 20: a loop that never ends still
    ends)."""
    from dplab.viz.budget import cores

    return min(max(os.getloadavg()[0] / cores(), 1.0), 20.0)


@dataclass(frozen=True)
class ExerciseReport:
    """One exercise's verdict: ``message`` says what is wrong in the lesson's words, or what was
    proven; ``output`` is what the learner's code printed (clipped), shown beside it."""

    name: str
    passed: bool
    message: str
    output: str = ""


class Fail(DplabError):
    """The learner's answer is wrong (or does not run): the message is what the learner reads."""


class CheckUnavailable(ConfigError):
    """The check itself cannot run on this machine (a full /dev/shm):
    not a verdict on the answer."""


class TooLong(BaseException):
    """The learner's code ran past the check's time limit: a loop that never ends, most likely.

    A BaseException, so that a learner's ``except Exception:`` around a loop does not swallow it."""


def clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


_repr = reprlib.Repr()
_repr.maxlist = _repr.maxtuple = _repr.maxset = _repr.maxdict = 8
_repr.maxstring = _repr.maxother = 80
_repr.maxlevel = 3


def short_repr(value: Any) -> str:
    """``repr(value)`` cut short: a returned giant list is quoted by its first items."""
    try:
        return clip(_repr.repr(value), 200)
    except Exception:  # the learner's own __repr__ raised
        return f"a {type(value).__name__}"


@contextmanager
def same_process() -> Iterator[None]:
    """Around the learner's code: a process it forked ends here, silently, when it comes back, so
    that only the process that started the check answers (a fork would judge and report twice);
    one still running then is killed, so that it holds no rank's pipe open past the call."""
    pid, before = os.getpid(), _children()
    try:
        yield
    finally:
        if os.getpid() != pid:
            os._exit(0)
        for child in _children() - before:
            try:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _children() -> set[int]:
    """This process's children (Linux: /proc/self/task/*/children; elsewhere none are known)."""
    out: set[int] = set()
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/children") as f:
                out.update(int(pid) for pid in f.read().split())
    except OSError:
        pass
    return out


def load_function(file: Path, name: str) -> Callable[..., Any]:
    """Import ``file`` under a fresh module name (so an edited file is read again) and return
    ``name``."""
    file = Path(file)
    if not file.is_file():
        raise Fail(f"there is no {file.name} in {file.parent}: run `dplab lesson init "
                   f"{file.parent}` to get the stubs, then write your answer in {file.name}")
    module_name = f"_dplab_exercise_{file.stem}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise Fail(f"{file} cannot be imported as Python: it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name
    try:
        with same_process():
            spec.loader.exec_module(module)
    except SyntaxError as e:
        code = (e.text or "").strip()
        raise Fail(f"{file.name} is not valid Python: {e.msg} at line {e.lineno}"
                   + (f": `{clip(code, 120)}`" if code else "")) from None
    except BaseException as e:  # what runs at import is the learner's code too: an exit, a loop
        raise Fail(describe(e, file, f"importing {file.name}")) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise Fail(f"{file.name} defines no function {name}: keep the stub's name and signature")
    return fn


@contextmanager
def learner_call(file: Path, what: str) -> Iterator[None]:
    """Around a call of the learner's function: whatever it raises (an exception, ``sys.exit``, the
    time limit's ``TooLong``) becomes a ``Fail`` naming their line; a fork of theirs ends here."""
    try:
        with same_process():
            yield
    except Fail:
        raise
    except BaseException as e:
        raise Fail(describe(e, file, what)) from None


def describe(exc: BaseException, file: Path, what: str) -> str:
    """``"ring_reduce_scatter raised ValueError: ... (line 31 of ring_reduce_scatter.py:
    `code`)"``."""
    if isinstance(exc, SystemExit):
        text = (f"{what} called sys.exit({short_repr(exc.code) if exc.code is not None else ''}): "
                "an exercise returns its answer instead of ending the program")
    else:
        message = clip(str(exc))
        text = f"{what} raised {type(exc).__name__}" + (f": {message}" if message else "")
        if isinstance(exc, MemoryError):
            text += _memory_limit()
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if _same(f.filename, file)]
    if mine:
        code = clip(mine[-1].line.strip(), 120) if mine[-1].line else ""
        text += f" (line {mine[-1].lineno} of {Path(file).name}" + (f": `{code}`)" if code else ")")
    return text


def _memory_limit() -> str:
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" (the check allows {soft >> 20:,} MiB of memory; $DPLAB_CHECK_MEMORY_MB sets that)"


_FRAME = re.compile(r'  File "(?P<file>[^"\n]+)", line (?P<line>\d+), in [^\n]*')
# frames are read from the first and last 200,000 characters: a huge message is not
_TAIL_CHARS = 200_000


def describe_rank_error(detail: str, rank: int, file: Path, what: str) -> str:
    """The same sentence from a rank's traceback text (a ``RankError``'s ``detail``)."""
    text = f"{what} raised on rank {rank}: {_last_line(detail)}"
    mine = _learner_frames(detail, file)
    if mine:
        line, code = mine[-1]
        text += f" (line {line} of {Path(file).name}" + (f": `{clip(code, 120)}`)" if code else ")")
    return text


def _last_line(detail: str) -> str:
    detail = detail.rstrip()
    last = detail[detail.rfind("\n") + 1:].strip()
    # dplab.reference.errors.ConfigError: -> ...
    head = re.sub(r"^[\w.]+\.(\w+):", r"\1:", last[:1000])
    return clip(head + last[1000:]) if last else "an error without a message"


def _learner_frames(detail: str, file: Path) -> list[tuple[str, str]]:
    """(line, code) of every frame of ``file`` in a traceback's text, oldest first."""
    lines = detail[:_TAIL_CHARS].splitlines() + detail[_TAIL_CHARS:][-_TAIL_CHARS:].splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line[:2000])
        if m and _same(m["file"], file):
            out.append((m["line"], lines[i + 1].strip() if i + 1 < len(lines) else ""))
    return out


# what a rank's error says when the machine, not the answer, stopped it: always, or with no frame of
# the learner's in the traceback
_MACHINE = re.compile(r"^(ShmFull|BackendUnavailable):")
_MACHINE_UNLESS_THEIRS = re.compile(
    r"^(OSError|PermissionError|BlockingIOError|MemoryError)\b|/dev/shm"
)


def rank_failure(error: Any, file: Path, what: str) -> Fail | CheckUnavailable:
    """A ``RankError`` as the learner's ``Fail``, or as ``CheckUnavailable`` when it names the
    machine (``ShmFull``: /dev/shm is full; an ``OSError`` raised outside the learner's code)."""
    last = _last_line(error.detail)
    if _MACHINE.match(last) or (_MACHINE_UNLESS_THEIRS.search(last)
                                and not _learner_frames(error.detail, file)):
        return CheckUnavailable(f"cannot check {Path(file).name} on this machine: {last}")
    return Fail(describe_rank_error(error.detail, error.rank, file, what))


def _same(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):
        return False


def judged(name: str, judge: Callable[[Path], str]) -> Callable[[Path], ExerciseReport]:
    """``judge(file)`` returns what a right answer proved, or raises ``Fail``: as a report, always.
    ``CheckUnavailable`` (and any error of the machine's) is raised: it is no verdict."""

    def report(passed: bool, message: str, output: list[str]) -> ExerciseReport:
        # what the learner's code printed or raised is quoted: never an escape sequence that acts
        return ExerciseReport(name, passed, printable(clip(message, 4 * MESSAGE_CHARS)),
                              printable("".join(output)))

    def checker(file: Path) -> ExerciseReport:
        output: list[str] = []
        try:
            return report(True, judge(Path(file), output), output)
        except Fail as e:
            return report(False, str(e), output)
        except CheckUnavailable as e:
            raise CheckUnavailable(printable(str(e))) from None
        except (ConfigError, OSError) as e:  # a full /dev/shm, a world that could not start
            raise CheckUnavailable(f"cannot check {Path(file).name} on this machine: "
                                   f"{printable(clip(str(e)))}") from None
        except Exception as e:  # the learner's answer broke the checker itself: still a report
            said = describe(e, Path(file), f"checking {Path(file).name}")
            return report(False, said + " (the checker could not judge this answer: report it if "
                                        "it looks right)", output)

    checker.__name__ = f"check_{name}"
    checker.__doc__ = judge.__doc__
    return checker
