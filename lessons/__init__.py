"""Step-through lessons: every idea of data parallelism taught on the real engine.

    dplab lesson  # the list: length, needs, your progress and prediction score; where to start
    dplab lesson 1               # step through lesson 1 (Enter: next, b: back, h: hint, q: quit)
    dplab lesson watch 2 DIR     # re-check lesson 2's exercises in DIR on every save
    dplab app                    # the same steps on the app's Lessons page

A lesson is a module ``lessons/lNN_<slug>.py`` that defines ``LESSON`` (``lessons/step.py``
says what a step is); ``lessons/runner.py`` runs its steps, CI runs every one of them.
"""

from __future__ import annotations

import importlib

from dplab.lessons.plain import count, num, size, times
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step, fill
from dplab.reference.errors import ConfigError

__all__ = ["MODULES", "numbers", "lessons", "lesson", "Lesson", "Step", "Check", "Predict",
           "Explore", "fill", "num", "times", "size", "count"]

# In teaching order: each lesson may use what the ones before it taught.
MODULES = (
    "l01_replicas",
    "l02_allreduce",
    "l03_cost",
    "l04_buckets",
    "l05_scaling",
    "l06_large_batches",
    "l07_async",
    "l08_stragglers",
    "l09_faults",
    "l10_memory",
    "l11_precision",
    "l12_engines",
    "l13_batch_size",
    "l14_real_model",
    "l15_torch_stack",
)


def lessons() -> list[Lesson]:
    """Every lesson, in order (importing each module; the figures' plotly loads only when drawn)."""
    return [importlib.import_module(f"dplab.lessons.{m}").LESSON for m in MODULES]


def numbers() -> list[int]:
    """The lessons' numbers, from their module names (``l07_async`` is lesson 7)."""
    return [int(m[1:3]) for m in MODULES]


def lesson(number: int) -> Lesson:
    """Lesson ``number``, or an error listing the ones there are."""
    if number not in numbers():
        raise ConfigError(f"there is no lesson {number}: the lessons are "
                          f"{', '.join(map(str, numbers()))} (dplab lesson lists them)")
    return importlib.import_module(f"dplab.lessons.{MODULES[numbers().index(number)]}").LESSON
