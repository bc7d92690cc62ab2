"""Exercises: steps of the lessons ask the learner to write the code, and the engine judges it.

    dplab lesson init work            # copies the stubs into ./work (never over your files)
    dplab lesson check 2 work         # runs work/ring_reduce_scatter.py against the simulator

    from dplab.lessons.exercises import check, init_dir
    init_dir(Path("work"))
    for report in check(2, Path("work")):
        print(report.name, report.passed, report.message)

A stub (``stubs/``) has the function's signature, a docstring that explains the task and a body
that is deliberately wrong, so checking a fresh stub already speaks in the lesson's words; the
answers are in ``solutions/``, and CI proves every stub fails and every solution passes. The
learner's code runs in a child process under a time and a memory limit (``$DPLAB_CHECK_LIMIT_S``,
default 30 times the load per core, at least 1; ``$DPLAB_CHECK_MEMORY_MB``, default 4096); only
plain data comes back (``child.py``).
"""

from __future__ import annotations

import errno
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from dplab.lessons.exercises.child import check_settings
from dplab.lessons.exercises.learner import ExerciseReport, judged
from dplab.reference.errors import ConfigError

__all__ = ["Exercise", "ExerciseReport", "EXERCISES", "STUBS", "SOLUTIONS", "init_dir", "check",
           "check_file", "exercise_folder", "check_settings"]

STUBS = Path(__file__).parent / "stubs"
SOLUTIONS = Path(__file__).parent / "solutions"


@dataclass(frozen=True)
class Exercise:
    """One exercise: the lesson that asks for it, the file the learner edits, and its judge."""

    lesson: int
    title: str
    # file name: in stubs/, solutions/, the learner's folder
    stub: str
    solution: Path                             # the shipped answer
    # "module:function", judge(the learner's file, output) -> what a right answer proved, or Fail:
    # imported at its first check, so that a check's child process (which imports this package)
    # loads its own exercise's modules, not every exercise's engine
    judge: str

    @property
    def stub_path(self) -> Path:
        return STUBS / self.stub

    def checker(self, file: Path) -> ExerciseReport:
        """The report on ``file`` as this exercise's answer (``CheckUnavailable``: the machine
        cannot run the check)."""
        module, function = self.judge.split(":")
        judge = getattr(importlib.import_module(module), function)
        return judged(Path(self.stub).stem, judge)(file)


def _exercise(name: str, lesson: int, title: str, judge: str) -> Exercise:
    return Exercise(lesson, title, f"{name}.py", SOLUTIONS / f"{name}.py",
                    f"dplab.lessons.exercises.{judge}")


EXERCISES: dict[str, Exercise] = {
    "ring_reduce_scatter": _exercise("ring_reduce_scatter", 2, "The ring reduce-scatter as a "
                                                               "schedule",
                                     "ring:judge_ring"),
    "ddp_buckets": _exercise("ddp_buckets", 4, "DDP's bucket assignment", "buckets:judge_buckets"),
    "ssp_gate": _exercise("ssp_gate", 7, "The SSP staleness gate", "ssp:judge_ssp"),
    "zero2_step": _exercise("zero2_step", 10, "A ZeRO-2 step", "zero2:judge_zero2"),
}
# appended: the ladder's lower rungs (lesson 2), each judged by its own module
EXERCISES["ring_allgather"] = _exercise("ring_allgather", 2, "The ring all-gather as a schedule",
                                        "ring_allgather:judge_ring_allgather")
EXERCISES["tree_broadcast"] = _exercise("tree_broadcast", 2, "A binomial-tree broadcast as a "
                                                             "schedule",
                                        "tree:judge_tree")


# appended: lesson 11's dynamic loss scaler
EXERCISES["loss_scaler"] = _exercise(
    "loss_scaler", 11, "The dynamic loss scaler's rule", "scaler:judge_scaler"
)

# appended: lesson 10's FSDP unit
EXERCISES["fsdp_unit"] = _exercise("fsdp_unit", 10, "An FSDP unit's gather and free",
                                   "fsdp_unit:judge_fsdp")

# appended: lesson 8's backup workers, the first n of N + b gradients
EXERCISES["backup_step"] = _exercise("backup_step", 8, "Backup workers: the first n of N + b "
                                                       "gradients",
                                     "backup:judge_backup")

# appended: lesson 15's DDP from hooks on torch tensors (CS336's exercise)
EXERCISES["ddp_hooks"] = _exercise(
    "ddp_hooks", 15, "DDP from hooks on torch tensors", "ddp_hooks:judge_ddp_hooks"
)

# appended: lesson 15's FSDP forward that prefetches, judged on the simulated cluster
EXERCISES["fsdp_prefetch"] = _exercise("fsdp_prefetch", 15, "A prefetching FSDP forward",
                                       "fsdp_prefetch:judge_fsdp_prefetch")


def init_dir(path: str | Path) -> list[Path]:
    """Copy every stub into ``path`` (created if need be); returns the files written.

    Refuses, writing nothing, if any of them exists already (a link too, even a dangling one:
    writing through it would land outside ``path``), and says in one line why a folder cannot be
    made or written."""
    if not str(path).strip():
        raise ConfigError("dplab lesson init needs a folder name: dplab lesson init DIR (an empty "
                          "name would be the current folder; say . if that is what you mean)")
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"{path} is a file: give dplab lesson init a folder for the exercises"
            )
        targets = [path / e.stub for e in EXERCISES.values()]
        there = [t for t in targets if os.path.lexists(t)]
    except OSError as e:  # a folder on the way that we may not read
        raise ConfigError(f"cannot look into {path} ({e.strerror or e}): give dplab lesson init a "
                          "folder you can write to") from None
    if there:
        names = ", ".join(str(t) for t in there)
        raise ConfigError(f"{names} already exist{'s' if len(there) == 1 else ''}: dplab lesson "
                          "init never overwrites a learner's file; check your work with "
                          f"`dplab lesson check N {path}`, or init another folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the folder {path} ({e.strerror or e}): give dplab lesson "
                          "init a folder you can write to") from None
    written: list[Path] = []
    target = path
    try:
        for exercise, target in zip(EXERCISES.values(), targets):
            _write_new(target, exercise.stub_path.read_bytes())
            written.append(target)
    except OSError as e:
        for done in written:  # all or nothing: a half-initialised folder would be refused next time
            done.unlink(missing_ok=True)
        said = (
            "a file or link of that name appeared"
            if e.errno == errno.EEXIST
            else e.strerror or str(e)
        )
        raise ConfigError(f"cannot write {target} ({said}): give dplab lesson init a folder you "
                          "can write to") from None
    return targets


def _write_new(target: Path, data: bytes) -> None:
    """Create ``target`` with ``data``; never through a link, never over a file (O_EXCL)."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:
        target.unlink(missing_ok=True)  # ours: created just now
        raise


def check(lesson: int, path: Path | None = None) -> list[ExerciseReport]:
    """Judge the learner's file for each exercise of ``lesson`` (in ``path``, default: cwd):
    a report each."""
    chosen = [e for e in EXERCISES.values() if e.lesson == lesson]
    if not chosen:
        which = ", ".join(str(n) for n in sorted({e.lesson for e in EXERCISES.values()}))
        raise ConfigError(f"lesson {lesson} has no exercise: lessons {which} have exercises "
                          "(dplab lesson check N DIR)")
    folder = Path.cwd() if path is None else exercise_folder(path)
    check_settings()  # a bad $DPLAB_CHECK_* is one line before any child starts, not a verdict
    return [e.checker(folder / e.stub) for e in chosen]


def exercise_folder(path: str | Path) -> Path:
    """``path`` as the learner's folder of exercises; a ConfigError (one line) if it is none."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder: dplab lesson init {folder} copies the "
                          "exercises there")
    return folder


def check_file(name: str, file: Path) -> ExerciseReport:
    """Judge one file as the answer to exercise ``name`` (e.g. a solution kept under another
    name)."""
    if name not in EXERCISES:
        raise ConfigError(f"there is no exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    check_settings()
    return EXERCISES[name].checker(Path(file))

# appended: lesson 10's clipping by the global norm of a sharded gradient
EXERCISES["sharded_clip"] = _exercise("sharded_clip", 10, "Clipping a sharded gradient by its norm",
                                      "sharded_clip:judge_sharded_clip")
