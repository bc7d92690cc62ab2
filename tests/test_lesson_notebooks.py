"""Every lesson as a Jupyter notebook: written by ``dplab lesson notebooks DIR``, and executed here
with nbclient, which is how CI runs every step of every lesson (marker ``lessons``): a step whose
claim stops being true, or a notebook that no longer runs, fails its lesson's test.

    pytest -m lessons tests/test_lesson_notebooks.py

One kernel serves lessons 1-9 here (its start-up and imports are paid once, and its ``Lab`` keeps
the worlds of ranks between lessons), another lessons 10-15 in ``test_lesson_notebooks_torch.py``
(tests/notebooks.py says why two); each lesson's steps run in order, as a learner meets them.
After a lesson's cells, one more cell (``_check_outcomes``, sent as source) checks in the kernel
what the terminal's and the app's tests need of every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from notebooks import kernel_at, run_notebook, split

from dplab.lessons import lessons, numbers


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One Python kernel (this interpreter's) for lessons 1-9, without torch."""
    km = kernel_at(tmp_path_factory.mktemp("kernel"), torch=False)
    yield km
    km.shutdown_kernel()  # asked, not killed: the kernel closes its Lab (its ranks) at exit


# slow as well: every step of every lesson runs here, 40-45 s of each worker (about 90 s of
# the two cores), and the default pytest runs what a change to the code needs; `pytest -m
# lessons` runs them in under a minute, and CI's second tier every time
@pytest.mark.lessons
@pytest.mark.slow
@pytest.mark.parametrize("number", split(torch=False))
def test_every_lesson_notebook_runs_and_its_claims_hold(kernel, number):
    run_notebook(kernel, number)


@pytest.mark.lessons
def test_the_two_kernels_share_every_lesson_between_them():
    assert sorted(split(torch=False) + split(torch=True)) == numbers()
    assert split(torch=False) and split(torch=True)


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
