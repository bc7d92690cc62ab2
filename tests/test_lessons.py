"""The lessons' structure: numbered in order, naming known ideas (marker ``lessons``). Every step of
every lesson runs, its claims checked and its shown code held to a terminal's width, when CI
executes the lessons' notebooks (``tests/test_lesson_notebooks.py``).

    pytest -m lessons                 # the lessons: these, and every lesson's notebook run
"""

from __future__ import annotations

import pytest

from dplab.lessons import MODULES, lessons, numbers
from dplab.lessons.coverage import CONCEPTS

pytestmark = pytest.mark.lessons


def test_lessons_are_numbered_in_order_and_name_known_ideas():
    assert numbers() == sorted(set(numbers())), MODULES
    for module, les in zip(MODULES, lessons()):
        assert module == f"l{les.number:02d}_{les.slug}", (module, les.number, les.slug)
        for step in les.steps:
            assert set(step.teaches) <= set(CONCEPTS), (les.number, step.title, step.teaches)
