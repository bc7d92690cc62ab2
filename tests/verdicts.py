"""``verdict(name, file)``: ``check_file``'s report on a file, judged once per test session.

The shipped solutions and stubs are judged by several tests (every solution passes; each lesson's
own file checks its wording; every stub fails): each verdict is a child process with its own ranks
(1-4 CPU-seconds), and the same file gets the same verdict, so the session keeps the first one.

    from verdicts import verdict
    assert verdict("zero2_step", SOLUTIONS / "zero2_step.py").passed
"""

from __future__ import annotations

from pathlib import Path

from dplab.lessons.exercises import ExerciseReport, check_file

__all__ = ["verdict"]

_REPORTS: dict[tuple[str, Path, bytes], ExerciseReport] = {}


def verdict(name: str, file: Path) -> ExerciseReport:
    """``check_file(name, file)``, kept for the session under the file's path and contents.

    Args:
        name: the exercise, as ``check_file`` takes it.
        file: the file judged as its answer.

    Returns:
        The report of the first check of this exercise on this file, with these contents.
    """
    file = Path(file)
    key = (name, file.resolve(), file.read_bytes())
    if key not in _REPORTS:
        _REPORTS[key] = check_file(name, file)
    return _REPORTS[key]
