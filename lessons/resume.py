"""Where the learner stopped in each lesson, and how long each step took to run here.

    positions = Positions.load()  # $DPLAB_HOME/lessons.json, else ~/.cache/dplab/lessons.json
    positions.step(1)  # 3: ``dplab lesson 1`` resumes at step 3; None: from the start
    positions.save(1, step=3, seconds={1: 2.4})
    positions.save(1, step=None)          # finished: the next run starts from the beginning
    positions.save(1, step=2, answers={1: ("close", False)})   # a reply and whether it was right
    positions.score(1)  # (right, asked): (0, 1); positions.done(1), positions.seen(1)

The file is a cache, never a reason to fail or to hang: one that is unreadable, not UTF-8, not
the expected JSON (too deep, too large, ``1e309``), or not a regular file (a FIFO, a link to
/dev/zero) is ignored with a one-line warning (``positions.warning``) and rewritten on the next
save; one that cannot be written is a warning too. A save re-reads the file under a lock
(``fcntl.flock`` on ``lessons.json.lock``) and changes only its own lesson, then replaces the
file atomically (a temporary file and ``os.replace``), so two ``dplab lesson`` runs at once keep
both resume points. The step times feed the progress bar's ETA and the listing's estimated length;
the answers (the last reply to each question, right or not; a skipped one is asked, not right), the
furthest step seen and whether the lesson was finished feed the listing's progress and score.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: saves are atomic but not merged under a lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["Positions", "Answer", "store_path", "MAX_BYTES", "MAX_STEP"]

Answer = tuple[str, bool | None]  # (the reply, right?) - None: skipped, shown without an answer

FILE_NAME = "lessons.json"
MAX_BYTES = 1 << 20  # a dozen lessons take a few KB
MAX_STEP = 10_000    # a stored step beyond this is nonsense, not a place to resume
MAX_REPLY = 100      # characters of a reply kept: what a person types for an answer


def store_path() -> Path:
    """``$DPLAB_HOME/lessons.json`` when ``DPLAB_HOME`` is set, else
    ``~/.cache/dplab/lessons.json``."""
    home = os.environ.get("DPLAB_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "dplab") / FILE_NAME


class _Corrupt(ValueError):
    """The file is there but holds nothing we can use: the reason, for the warning."""


def _read(path: Path) -> dict[str, Any] | None:
    """The stored object, None when there is no file; ``_Corrupt`` or ``OSError`` otherwise.

    Opened without blocking (a FIFO with no writer would wait forever) and read only if it is a
    regular file of at most ``MAX_BYTES`` (a link to /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Corrupt("not a regular file")
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise _Corrupt(f"larger than {MAX_BYTES >> 20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError:
        raise _Corrupt("not UTF-8 text") from None
    except RecursionError:
        raise _Corrupt("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError; an integer of more than 4,300 digits
        raise _Corrupt(str(e).splitlines()[0][:80] if str(e) else "not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("lessons"), dict) or not all(
            isinstance(v, dict) for v in data["lessons"].values()):
        raise _Corrupt("not the expected {'lessons': {...}} object")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e309: a float's range ends near 1.8e308
        raise ValueError(f"{text[:20]} is beyond a float's range")
    return value


class Positions:
    """The stored state of every lesson: ``{"lessons": {"1": {"step": 3, "seconds": {"1":
    2.4}}}}``."""

    def __init__(self, path: Path, data: dict[str, Any], warning: str | None = None) -> None:
        self.path, self.data, self.warning = path, data, warning

    @classmethod
    def load(cls, path: Path | None = None) -> Positions:
        path = store_path() if path is None else path
        try:
            data = _read(path)
        except OSError as e:
            return cls(path, {"lessons": {}}, f"cannot read {path} ({e.strerror or e}): starting "
                                              "from step 1")
        except _Corrupt as e:
            return cls(path, {"lessons": {}}, f"ignoring {path}, which is corrupt ({e}); it is "
                                              "rewritten on the next save")
        return cls(path, data if data is not None else {"lessons": {}})

    def _entry(self, lesson: int) -> dict[str, Any]:
        return self.data["lessons"].get(str(lesson), {})

    def step(self, lesson: int) -> int | None:
        """The 1-based step ``lesson`` resumes at, or None (never started, finished, or
        nonsense)."""
        step = self._entry(lesson).get("step")
        ok = isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= MAX_STEP
        return step if ok else None

    def seconds(self, lesson: int) -> dict[int, float]:
        """Step number -> how long its run took last time here (what the ETA is made of)."""
        return _seconds(self._entry(lesson))

    def answers(self, lesson: int) -> dict[int, Answer]:
        """Step number -> the learner's last reply to its question and whether it was right."""
        return _answers(self._entry(lesson))

    def score(self, lesson: int) -> tuple[int, int]:
        """(right, asked) over the questions of ``lesson`` the learner met (a skipped one is
        asked)."""
        answers = self.answers(lesson).values()
        return sum(ok is True for _, ok in answers), len(answers)

    def done(self, lesson: int) -> bool:
        """Whether the learner reached the end of ``lesson`` at least once."""
        return self._entry(lesson).get("done") is True

    def seen(self, lesson: int) -> int:
        """The furthest step (1-based) of ``lesson`` the learner was shown; 0: never started."""
        seen = self._entry(lesson).get("seen")
        ok = isinstance(seen, int) and not isinstance(seen, bool) and 0 <= seen <= MAX_STEP
        return max(seen if ok else 0, self.step(lesson) or 0)

    def save(self, lesson: int, step: int | None, seconds: dict[int, float] | None = None,
             answers: dict[int, Answer] | None = None) -> str | None:
        """Record the position (None: finished), step times and answers; a failure is returned as a
        warning.

        Merged under a lock with what is on disk now: another run's lessons are kept."""
        target = _target(self.path)
        tmp: str | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _locked(target):
                try:
                    disk = _read(target) or {"lessons": {}}
                except (_Corrupt, OSError):  # rewritten: it was of no use
                    disk = {"lessons": {}}
                entry = dict(disk["lessons"].get(str(lesson), {}))
                if step is None:
                    entry.pop("step", None)
                    entry["done"] = True
                else:
                    entry["step"] = step
                    seen = entry.get("seen")
                    ok = (
                        isinstance(seen, int)
                        and not isinstance(seen, bool)
                        and 0 <= seen <= MAX_STEP
                    )
                    entry["seen"] = max(step, seen if ok else 0)
                if answers:
                    merged_answers = {**_answers(entry), **answers}
                    entry["answers"] = {str(k): {"reply": r[:MAX_REPLY], "correct": ok}
                                        for k, (r, ok) in sorted(merged_answers.items())}
                if seconds:
                    merged = {**_seconds(entry), **seconds}
                    entry["seconds"] = {str(k): round(v, 3) for k, v in sorted(merged.items())}
                disk["lessons"][str(lesson)] = entry
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
                )
                # mkstemp's 0600 would hide the file from its owner's group
                os.fchmod(fd, _mode(target))
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(disk, indent=1, sort_keys=True))
                os.replace(tmp, target)  # atomic: a reader never sees half a file
                tmp = None
            self.data = disk
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return f"cannot save the position to {self.path} ({e.strerror or e})"
        return None


def _answers(entry: dict[str, Any]) -> dict[int, Answer]:
    raw = entry.get("answers", {})
    out: dict[int, Answer] = {}
    for k, v in (raw.items() if isinstance(raw, dict) else ()):
        if (
            str(k).isdigit()
            and len(str(k)) < 6
            and isinstance(v, dict)
            and isinstance(v.get("reply"), str)
            and v.get("correct") in (True, False, None)
        ):
            out[int(k)] = (v["reply"][:MAX_REPLY], v["correct"])
    return out


def _seconds(entry: dict[str, Any]) -> dict[int, float]:
    raw = entry.get("seconds", {})
    out = {}
    for k, v in (raw.items() if isinstance(raw, dict) else ()):
        if (
            str(k).isdigit()
            and len(str(k)) < 6
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
        ):
            out[int(k)] = float(v)
    return out


def _mode(target: Path) -> int:
    try:
        info = target.stat()
        return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else 0o644
    except OSError:
        return 0o644


def _target(path: Path) -> Path:
    """Where a save writes: through a link to a regular file (a dotfiles setup), else at ``path``
    itself, replacing a link to anything else (/dev/zero) or a FIFO rather than writing into it."""
    try:
        if path.is_symlink() and path.resolve().is_file():
            return path.resolve()
    except (OSError, RuntimeError):  # a loop of links
        pass
    return path


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold ``target.lock`` exclusively: one save at a time reads, merges and replaces."""
    if fcntl is None:
        yield
        return
    lock = target.with_name(f"{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
