"""The lessons' structure: numbered in order, naming known ideas, their code fitting a terminal
(marker ``lessons``). Every step of every lesson runs, its claims checked, when CI executes the
lessons' notebooks (``tests/test_lesson_notebooks.py``).

    pytest -m lessons                 # just the lessons (under a minute on two cores)
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


SHOWN_WIDTH = 79       # the code a lesson writes must read in an 80-column terminal without wrapping
SPINE_WIDTH = 110      # the spine a step shows (Step.show) is the project's code, at ruff's line length;
                       # the terminal word-wraps it (lessons/render.py)


def _shown_pieces(step):
    """(source, width allowed) of each piece of code the step shows."""
    from dplab.lessons.step import _resolve, _source
    if not step.show:
        return [(step.harness(), SHOWN_WIDTH)]
    out = []
    for obj in step.show:
        target = _resolve(obj) if isinstance(obj, str) else obj
        ours = getattr(target, "__module__", "").startswith("dplab.lessons.l")
        out.append((_source(obj), SHOWN_WIDTH if ours else SPINE_WIDTH))
    return out


def test_shown_code_fits_an_80_column_terminal():
    too_long = [f"lesson {les.number} step {i} ({step.title!r}) line {j}, {len(line)} chars: {line.strip()}"
                for les in lessons() for i, step in enumerate(les.steps, 1)
                for code, width in _shown_pieces(step)
                for j, line in enumerate(code.splitlines(), 1) if len(line) > width]
    assert not too_long, (f"{len(too_long)} shown lines are wider than {SHOWN_WIDTH}:\n"
                          + "\n".join(too_long[:20]))
