"""Lessons 10-15 as Jupyter notebooks, executed in their own kernel (with torch imported first):
``tests/test_lesson_notebooks.py`` runs lessons 1-9, at once beside this one under xdist
(``tests/notebooks.py`` says why two kernels).

    pytest -m lessons tests/test_lesson_notebooks_torch.py
"""

from __future__ import annotations

import pytest
from notebooks import kernel_at, run_notebook, split


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One Python kernel (this interpreter's) for lessons 10-15, torch imported first."""
    km = kernel_at(tmp_path_factory.mktemp("kernel"), torch=True)
    yield km
    km.shutdown_kernel()  # asked, not killed: the kernel closes its Lab (its ranks) at exit


# slow as well: every step of every lesson runs here, 40-45 s of each worker (about 90 s of
# the two cores), and the default pytest runs what a change to the code needs; `pytest -m
# lessons` runs them in under a minute, and CI's second tier every time
@pytest.mark.lessons
@pytest.mark.slow
@pytest.mark.parametrize("number", split(torch=True))
def test_every_lesson_notebook_runs_and_its_claims_hold(kernel, number):
    run_notebook(kernel, number)
