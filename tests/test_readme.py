"""The README says what the code does: its Python example runs as written, its algorithm table
matches the schedules.

A README that drifts from the code teaches the wrong thing and nothing notices; these tests are
the noticing.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.schedule import chunk_bounds

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _python_example() -> str:
    section = README.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_example_is_short():
    assert len(_python_example().strip().splitlines()) <= 12


def test_the_python_example_runs_as_written_on_local_and_mpi(tmp_path):
    """Saved as a script and run from outside the repository, as a newcomer would."""
    try:
        check_backend("mpi")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    script = tmp_path / "demo.py"
    script.write_text(_python_example())
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:  # one line per launch: three ranks, each holding 1 + 2 + 3
        assert line.count("array([6., 6., 6., 6.])") == 3, line


def _sent(algorithm: str, p: int, n: int) -> list[int]:
    """Elements each rank sends over the whole schedule, counted from its transfers."""
    schedule = allreduce_schedule(algorithm, p)
    bounds = chunk_bounds(n, schedule.num_chunks)
    sent = [0] * p
    for transfers in schedule.rounds:
        for t in transfers:
            lo, hi = bounds[t.chunk]
            sent[t.src] += hi - lo
    return sent


@pytest.mark.parametrize("p", range(2, 13))
def test_the_algorithm_table_matches_the_schedules(p):
    n = 2 * 3 * 5 * 7 * 8 * 9 * 11  # divisible by every p here: the table's closed forms are exact
    lg = math.ceil(math.log2(p))
    rounds = {a: len(allreduce_schedule(a, p).rounds) for a in ("naive", "ring", "tree", "direct")}
    assert rounds == {"naive": 2, "ring": 2 * (p - 1), "tree": 2 * lg, "direct": 2}
    assert _sent("naive", p, n) == [(p - 1) * n] + [n] * (p - 1)
    assert _sent("ring", p, n) == [2 * (p - 1) * n // p] * p == _sent("direct", p, n)
    tree = _sent("tree", p, n)
    assert max(tree) == tree[0] == lg * n and min(tree) == n


@pytest.mark.parametrize("p", range(2, 13))
def test_the_new_rows_match_the_schedules(p):
    n = 2 * 3 * 5 * 7 * 8 * 9 * 11
    lg, m = math.ceil(math.log2(p)), p.bit_length() - 1
    q, f = 1 << m, int(p & (p - 1) != 0)
    rounds = {a: len(allreduce_schedule(a, p).rounds) for a in
              ("recursive_doubling", "rabenseifner", "pipelined_tree", "pipelined_ring", "hierarchical")}
    nodes = math.ceil(p / 2)
    assert rounds == {"recursive_doubling": m + 2 * f, "rabenseifner": 2 * m + 2 * f,
                      "pipelined_tree": 2 * lg + 7, "pipelined_ring": 2 * (p - 1) + 3,
                      "hierarchical": 2 * (2 - 1) + 2 * (nodes - 1)}
    if p % 2 == 0:
        assert len(allreduce_schedule("double_tree", p).rounds) == 2 * lg + 7
        assert _sent("hierarchical", p, n) == [2 * (p - 1) * n // p] * p
    assert max(_sent("recursive_doubling", p, n)) == (m + f) * n
    assert max(_sent("rabenseifner", p, n)) == 2 * (q - 1) * n // q + f * n
    if p >= 4:
        assert max(_sent("double_tree", p, n)) == 2 * n and max(_sent("pipelined_tree", p, n)) == 3 * n


def test_the_table_in_the_readme_is_the_one_tested():
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
            for line in README.splitlines() if re.match(r"\| (naive|ring|tree|direct) \|", line)}
    assert rows == {
        "naive": ["2", "root (p-1)n, every other rank n"],
        "ring": ["2(p-1)", "2(p-1)/p · n"],
        "tree": ["2⌈lg p⌉", "up to ⌈lg p⌉·n (the root; leaves n)"],
        "direct": ["2", "2(p-1)/p · n"],
    }


def test_the_readme_names_only_modules_that_exist():
    """Every ``dplab.x.y`` the README mentions imports (a renamed module breaks this, not a user)."""
    import importlib

    names = set(re.findall(r"\bdplab(?:\.\w+)+", README))
    assert names, "the README should name its modules"
    for name in sorted(names):
        parts = name.split(".")
        for k in range(len(parts), 1, -1):  # the longest importable prefix, the rest attributes
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ModuleNotFoundError:
                continue
            for attr in parts[k:]:
                obj = getattr(obj, attr)
            break
        else:
            pytest.fail(f"the README names {name}, which does not import")


def test_where_things_live_names_every_file():
    """The README's map of the tree lists every module: a new file must find its place there."""
    section = README.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    words = set(re.findall(r"[\w]+\.py|[\w]+/", section))
    root = Path(__file__).resolve().parents[1]
    missing = []
    for folder in ("reference", "backends", "viz", "lessons"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py") or path.name in words:
                continue
            missing.append(str(path.relative_to(root)))
        for path in sorted(p for p in (root / folder).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            if f"{path.name}/" not in words:
                missing.append(str(path.relative_to(root)) + "/")
    assert not missing, f"README's 'Where things live' does not mention {missing}"


def test_the_lessons_table_is_the_lessons():
    """Number, title, steps and needs of every lesson, as the README lists them."""
    from dplab.lessons import lessons

    section = README.split("## Lessons", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    listed = [tuple(cell.strip() for cell in row.strip("|").split("|")[:4]) for row in rows]
    actual = [(str(les.number), les.title, str(len(les.steps)), ", ".join(les.needs) or "-")
              for les in lessons()]
    assert listed == actual


def test_the_coverage_table_is_complete_and_current():
    """Every idea has a step, and the README's table is the one the lessons make."""
    from dplab.lessons.coverage import coverage, coverage_table

    assert [idea for idea, places in coverage().items() if not places] == []
    assert coverage_table() in README
