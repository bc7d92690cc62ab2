"""Running the lessons' notebooks in a Jupyter kernel: what ``tests/test_lesson_notebooks.py`` and
``tests/test_lesson_notebooks_torch.py`` share. Two files, so that xdist's two workers (a file each,
``--dist loadfile``) run the lessons in two kernels at once: lessons 1-9 in one, 10-15 (every lesson
whose ranks use torch) in the other, which imports torch before its first Lab forks ranks.

    from notebooks import kernel_at, run_notebook
    km = kernel_at(folder, torch=True)
    run_notebook(km, 12)   # every step of lesson 12 in order; a claim that fails raises
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dplab.lessons import lesson, numbers
from dplab.lessons.runner import missing_needs

__all__ = ["APP_PAGES", "FIRST_TORCH_LESSON", "kernel_at", "run_notebook", "split"]

APP_PAGES = {"collectives", "cost", "training", "runs", "lessons"}
FIRST_TORCH_LESSON = 10  # lessons 10, 11, 12, 14 and 15 use torch in the kernel or its ranks


def split(torch: bool) -> list[int]:
    """The lessons one kernel runs, in teaching order: from ``FIRST_TORCH_LESSON`` on (torch), or
    before it; together, every lesson."""
    return [n for n in numbers() if (n >= FIRST_TORCH_LESSON) == torch]


def _check_outcomes(les, app_pages):
    """In the kernel, after the notebook ran: every step ran, proves something, and its question,
    named mistakes, deep link and figure hold on this run's facts; the code it shows fits a
    terminal (resolving what a step shows imports torch: done here, where the lessons have), and
    its terminal picture draws from the run's facts (checked here, on the notebook's own run, rather
    than running every step a second time)."""
    import io

    from rich.console import Console

    from dplab.lessons.step import _resolve, _source
    from dplab.viz.deep_links import unread

    # The code a lesson writes must read in an 80-column terminal unwrapped; the spine a step
    # shows (Step.show) is the project's code at ruff's line length, or torch's own at its
    # flake8 limit, which the terminal word-wraps (lessons/render.py).
    def width(obj):
        module = getattr(_resolve(obj) if isinstance(obj, str) else obj, "__module__", "")
        return 79 if module.startswith("dplab.lessons.l") else 100 if module.startswith(
            "dplab.") else 120

    too_long = []
    for k, step in enumerate(les.lesson.steps, 1):
        pieces = [(step.harness(), 79)] if not step.show else [
            (_source(obj), width(obj)) for obj in step.show]
        too_long += [f"step {k} ({step.title!r}) line {j}, {len(line)} chars: {line.strip()}"
                     for code, width in pieces for j, line in enumerate(code.splitlines(), 1)
                     if len(line) > width]
    assert not too_long, "shown lines too wide:\n" + "\n".join(too_long[:20])

    assert sorted(les.outcomes) == list(range(1, len(les.lesson.steps) + 1)), sorted(les.outcomes)
    for k, step in enumerate(les.lesson.steps, 1):
        out = les.outcomes[k]
        assert step.checks, f"step {step.title!r} proves nothing: give it checks"
        assert step.code(), step.title
        if step.predict is not None:
            truth = step.predict.expected(out.facts)
            reply = f"{truth}" if not isinstance(truth, float) else repr(truth)
            assert step.predict.judge(out.facts, reply).correct, (step.title, reply)
            assert out.question()
            for what, _ in step.predict.misconceptions:  # a named mistake must be judged wrong
                if not callable(what):
                    verdict = step.predict.judge(out.facts, str(what))
                    assert not verdict.correct and verdict.misconception, \
                        (step.title, what, verdict)
        if step.explore is not None:
            assert step.explore.page in app_pages, step.explore.page
            query = step.explore.query(out.facts)  # a name the page ignores opens the wrong picture
            ignored = unread(step.explore.page, query)
            assert not ignored, (step.title, ignored)
        if step.figure is not None:
            assert out.figure is not None and len(out.figure.data) > 0, step.title
        if step.picture is not None:  # the terminal's picture (dplab lesson N), at 80 columns
            screen = io.StringIO()  # (not Jupyter's display, which rich picks in a kernel)
            Console(file=screen, width=80, color_system=None,
                    force_jupyter=False).print(step.picture(out.facts))
            assert screen.getvalue().strip(), (les.lesson.number, step.title)


def kernel_at(folder: Path, torch: bool) -> Any:
    """A started Python kernel (this interpreter's) working in ``folder``; ``torch``: with torch
    imported first. The caller shuts it down (asked, not killed: it closes its Lab at exit)."""
    for module in ("nbclient", "ipykernel"):
        pytest.importorskip(module, reason=f"running the notebooks needs {module}: "
                                           "pip install -e '.[all]'")
    from jupyter_client import KernelManager
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable  # this venv's Python, whatever kernels are installed
    # figures as plotly's JSON only: no plotly.js bundle copied into every executed notebook
    km.start_kernel(env={**os.environ, "PLOTLY_RENDERER": "plotly_mimetype"}, cwd=str(folder))
    if torch and importlib.util.find_spec("torch") is not None:
        # torch before the first Lab forks its ranks: every rank then inherits it (and the
        # launcher imports, before it forks, the dynamo that optimizers import at first use),
        # where each rank of a world forked earlier imported it again (~3 CPU-s a rank)
        NotebookClient(new_notebook(cells=[new_code_cell("import torch")]),
                       km=km, timeout=240).execute()
    return km


def run_notebook(km: Any, number: int) -> None:
    """Execute lesson ``number``'s notebook in the kernel ``km``, then ``_check_outcomes`` in it;
    a cell that raises fails here. Skips where the lesson's extras are missing."""
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell

    from dplab.lessons.notebook import notebook

    les = lesson(number)
    if missing_needs(les):
        pytest.skip(f"lesson {number} needs the extras {missing_needs(les)}: "
                    "pip install -e '.[all]'")
    nb = notebook(les)
    nb.cells.append(new_code_cell(f"{inspect.getsource(_check_outcomes)}\n\n"
                                  f"_check_outcomes(les, {sorted(APP_PAGES)!r})"))
    NotebookClient(nb, km=km, timeout=240).execute()  # a cell that raises fails here
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    figures = sum(1 for o in shown if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert figures == sum(1 for s in les.steps if s.figure is not None), figures
