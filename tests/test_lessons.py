"""Every step of every lesson runs on the real engine and its claims hold (marker ``lessons``).

    pytest -m lessons                 # just the lessons (a few minutes on two cores)

One test per lesson, its steps in order on one ``Lab`` (shared worlds), as a learner meets them.
"""

from __future__ import annotations

import pytest

from dplab.lessons import MODULES, lesson, lessons, numbers
from dplab.lessons.coverage import CONCEPTS
from dplab.lessons.runner import Lab, missing_needs, run_step
from dplab.viz.deep_links import unread

pytestmark = pytest.mark.lessons

APP_PAGES = {"collectives", "cost", "training", "runs", "lessons"}


@pytest.mark.parametrize("number", numbers())
def test_every_step_runs_and_its_claims_hold(number):
    les = lesson(number)
    if missing_needs(les):
        pytest.skip(f"lesson {number} needs the extras {missing_needs(les)}: pip install -e "
                    "'.[all]'")
    with Lab() as lab:
        for step in les.steps:
            out = run_step(step, lab)
            out.raise_if_failed()
            assert step.checks, f"step {step.title!r} proves nothing: give it checks"
            assert step.code(), step.title
            if step.predict is not None:
                truth = step.predict.expected(out.facts)
                reply = f"{truth}" if not isinstance(truth, float) else repr(truth)
                assert step.predict.judge(out.facts, reply).correct, (step.title, reply)
                assert out.question()
                for what, why in step.predict.misconceptions:
                    # a named mistake must be judged wrong
                    if not callable(what):
                        verdict = step.predict.judge(out.facts, str(what))
                        assert not verdict.correct and verdict.misconception, (
                            step.title,
                            what,
                            verdict,
                        )
            if step.explore is not None:
                assert step.explore.page in APP_PAGES, step.explore.page
                # names the page would ignore open the wrong picture
                query = step.explore.query(out.facts)
                assert not unread(step.explore.page, query), (
                    step.title,
                    unread(step.explore.page, query),
                )
            if step.figure is not None:
                assert out.figure is not None and len(out.figure.data) > 0, step.title


def test_lessons_are_numbered_in_order_and_name_known_ideas():
    assert numbers() == sorted(set(numbers())), MODULES
    for module, les in zip(MODULES, lessons()):
        assert module == f"l{les.number:02d}_{les.slug}", (module, les.number, les.slug)
        for step in les.steps:
            assert set(step.teaches) <= set(CONCEPTS), (les.number, step.title, step.teaches)


# the code a lesson writes must read in an 80-column terminal without wrapping
SHOWN_WIDTH = 79
# the spine a step shows (Step.show) is the project's code, at ruff's line length; the terminal
# word-wraps it (lessons/render.py)
SPINE_WIDTH = 110


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
    too_long = [f"lesson {les.number} step {i} ({step.title!r}) line {j}, {len(line)} chars: "
                f"{line.strip()}"
                for les in lessons() for i, step in enumerate(les.steps, 1)
                for code, width in _shown_pieces(step)
                for j, line in enumerate(code.splitlines(), 1) if len(line) > width]
    assert not too_long, (f"{len(too_long)} shown lines are wider than {SHOWN_WIDTH}:\n"
                          + "\n".join(too_long[:20]))
