"""Every lesson as a Jupyter notebook: written by ``dplab lesson notebooks DIR``, and executed here
with nbclient, which is how CI runs every step of every lesson (marker ``lessons``): a step whose
claim stops being true, or a notebook that no longer runs, fails its lesson's test.

    pytest -m lessons tests/test_lesson_notebooks.py

One kernel serves every notebook (its start-up and imports are paid once, and its ``Lab`` keeps
the worlds of ranks between lessons); each lesson's steps run in order, as a learner meets them.
After a lesson's cells, one more cell (``_check_outcomes``, sent as source) checks in the kernel
what the terminal's and the app's tests need of every step.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest

from dplab.lessons import lesson, lessons, numbers
from dplab.lessons.runner import missing_needs

APP_PAGES = {"collectives", "cost", "training", "runs", "lessons"}


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


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One Python kernel (this interpreter's) for every notebook of the module."""
    for module in ("nbclient", "ipykernel"):
        pytest.importorskip(module, reason=f"running the notebooks needs {module}: "
                                           "pip install -e '.[all]'")
    from jupyter_client import KernelManager
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable  # this venv's Python, whatever kernels are installed
    # figures as plotly's JSON only: no plotly.js bundle copied into every executed notebook
    km.start_kernel(env={**os.environ, "PLOTLY_RENDERER": "plotly_mimetype"},
                    cwd=str(tmp_path_factory.mktemp("kernel")))
    if importlib.util.find_spec("torch") is not None:
        # torch (and the dynamo that its optimizers import at first use) before lesson 1's Lab
        # forks its ranks, as a learner's kernel has it before lesson 12's: every rank then
        # inherits it, where each rank of a world forked earlier imported it again (~3 CPU-s a
        # rank, in lessons 10, 12 and 14)
        NotebookClient(new_notebook(cells=[new_code_cell("import torch, torch._dynamo")]),
                       km=km, timeout=240).execute()
    yield km
    km.shutdown_kernel()  # asked, not killed: the kernel closes its Lab (its ranks) at exit


@pytest.mark.lessons
@pytest.mark.parametrize("number", numbers())
def test_every_lesson_notebook_runs_and_its_claims_hold(kernel, number):
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
    NotebookClient(nb, km=kernel, timeout=240).execute()  # a cell that raises fails here
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    figures = sum(1 for o in shown if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert figures == sum(1 for s in les.steps if s.figure is not None), figures


def _notebooks(tmp_path, *args):
    command = [sys.executable, "-m", "dplab.backends.cli", "lesson", "notebooks", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_command_writes_one_notebook_per_lesson_from_the_steps(tmp_path):
    pytest.importorskip("nbformat", reason="writing notebooks needs nbformat: pip install .[all]")
    done = _notebooks(tmp_path, "out", "--repo", "https://example.org/dplab")
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "out").glob("*.ipynb"))
    names = [f"lesson{les.number:02d}_{les.slug}.ipynb" for les in lessons()]
    assert [f.name for f in files] == names
    for les, file in zip(lessons(), files):
        nb = json.loads(file.read_text())
        cells = nb["cells"]
        setup = "".join(cells[1]["source"])
        assert "pip" in setup and "'https://example.org/dplab'" in setup
        assert "--backend cuda" in setup
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"][2:]
        # each step: a question, its input cell and the step that judges it, or the step alone
        want = []
        for k, step in enumerate(les.steps, 1):
            want += ([f"les.ask({k})", "answer = ", f"les.step({k}, answer)"] if step.predict
                     else [f"les.step({k})"])
        cut = [c if not c.startswith("answer = ") else "answer = " for c in code]
        assert cut == want, file.name
        text = json.dumps(nb)
        for step in les.steps:  # the text comes from the run, never copied into the file
            opening = step.text[:60].replace('"', "")
            assert opening not in text.replace('\\"', ""), (file.name, step.title)


@pytest.mark.parametrize("args, says", [
    (["a-file"], "cannot make the folder"),
    (["a-file/sub"], "cannot make the folder"),
    (["out", "--step", "2"], "usage: dplab lesson notebooks DIR"),
    ([], "usage: dplab lesson notebooks DIR"),
    (["x", "y"], "usage: dplab lesson notebooks DIR"),
])
def test_bad_notebook_folders_are_one_line_and_exit_2(tmp_path, monkeypatch, cli_here, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    done = cli_here("lesson", "notebooks", *args)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_folder_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, cli_here):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    done = cli_here("lesson", "notebooks", str(ro))
    assert done.returncode == 2 and "cannot write into" in done.stderr, done.stderr
