"""The README says what the code does: the commands a newcomer types are the ones CI runs and
parse, its Python example runs as written, its algorithm table matches the schedules, its links
lead somewhere, and each folder's README maps every file in it.

A README that drifts from the code teaches the wrong thing and nothing notices; these tests are
the noticing.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kernels
import pytest

from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.schedule import chunk_bounds

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# what the default pytest leaves out: .ci/run runs it second
HEAVY = 'pytest -m "slow or browser or hosts"'
FOLDERS = ("reference", "backends", "viz", "lessons")  # each maps its files in its own README.md
DOCS = {path: path.read_text() for path in
        [ROOT / "README.md", *(ROOT / f / "README.md" for f in FOLDERS),
         ROOT / "backends" / "nn" / "README.md", ROOT / "backends" / "PERFORMANCE.md"]}


def _first_block() -> list[str]:
    """The commands the README starts with: what a newcomer types on a fresh machine."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_starts_with_install_train_test_and_app():
    assert README.index("```bash") < README.index("\n## "), "the commands come before any section"
    lines = _first_block()
    assert lines[:3] == ["python3 -m venv .venv && . .venv/bin/activate", 'pip install '
                                                                          '"torch==2.13.0"',
                         'pip install -e ".[all]"']
    assert {"dplab train --world-size 4", "pytest", "dplab app"} <= set(lines)


def test_the_install_and_test_commands_are_what_ci_runs():
    """.ci/run installs as the README says and runs the README's test command."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q "torch==2.13.0"' in ci and 'pip install -q -e ".[all]"' in ci
    assert ci.index("torch==2.13.0") < ci.index('-e ".[all]"')
    assert re.search(r"^ *pytest *(#|$)", ci, re.M), (
        ".ci/run must run the README's test command: pytest"
    )
    assert re.search(rf"^ *{re.escape(HEAVY)} *(#|$)", ci, re.M), f".ci/run must run {HEAVY} too"
    assert {"pytest", HEAVY} <= set(_first_block()), "the README shows both test commands"
    addopts = re.search(r'^addopts = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert "not slow and not browser and not hosts" in addopts, \
        "the default pytest leaves out what HEAVY runs"


def _dplab_commands() -> list[str]:
    """Every ``dplab ...`` line in the README's bash blocks, comments stripped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "dplab" in words:
                lines.append(words[words.index("dplab"):])
    return lines


def test_every_dplab_command_in_the_readme_parses():
    from dplab.backends.cli.args import build_parser

    commands = _dplab_commands()
    assert len(commands) >= 12
    for words in commands:
        build_parser().parse_args(words[1:])  # argparse exits 2 on an option that does not exist


def _train_row(env: dict[str, str]) -> tuple[list[str], list[str]]:
    """The header and the row of ``dplab train --world-size 4`` under ``env``, split in words."""
    proc = subprocess.run(
        [sys.executable, "-m", "dplab.backends.cli", "train", "--world-size", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "NO_COLOR": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    return out[0].split(), out[2].split()


def test_dplab_train_prints_what_the_readme_shows():
    """The newcomer's first run: the same columns, and the row within rounding of one device."""
    shown = re.search(r"```\n(backend +mode .*?)```", README, re.S).group(1).splitlines()
    header, row = _train_row(dict(os.environ))  # on the kernels tests/kernels.py pins
    assert header == shown[0].split()
    readme_row = shown[2].split()
    # backend .. ranks_identical are deterministic (the same float64 operations in the same order
    # every run, on the same kernels): the README shows exactly what the command prints; only
    # wall_s is the machine's
    assert row[:8] == readme_row[:8], f"the README's sample row is not what the run prints: {row}"
    assert float(row[6]) < 1e-12 and row[7] == "True"
    assert len(row) == len(readme_row) == 9 and float(readme_row[8]) > 0


def test_dplab_train_on_this_cpus_own_kernels_prints_what_the_readme_says():
    """Unpinned, a newcomer's CPU picks its own kernels: an AVX-512 CPU prints the digits the
    README names for it, an AVX2 one the sample's."""
    if not kernels.has_avx2():
        pytest.skip("the README names what AVX2 and AVX-512 kernels print: this CPU has neither")
    sample = re.search(r"```\n(backend +mode .*?)```", README, re.S).group(1).splitlines()[2]
    avx512 = re.search(r"AVX-512 ones ([\d.e+-]+[\d])", README).group(1)
    _, row = _train_row({k: v for k, v in os.environ.items() if k not in kernels.KERNELS})
    expected = avx512 if "avx512f" in kernels.cpu_flags() else sample.split()[6]
    assert row[6] == expected, f"on this CPU's kernels the run prints {row}"
    assert row[:6] + row[7:8] == sample.split()[:6] + sample.split()[7:8]


def test_links_in_the_docs_lead_somewhere():
    """Every relative markdown link names a file that exists, and a #section it has."""
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    for path, text in DOCS.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), (
                f"{path.relative_to(ROOT)} links to {target}, which does not exist"
            )
            if anchor and dest.suffix == ".md":
                headings = {slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                assert anchor in headings, (
                    f"{path.relative_to(ROOT)} links to {target}: no such section"
                )


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 280, "reference material goes to a folder's README"


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
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
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
    rounds = {
        a: len(allreduce_schedule(a, p).rounds)
        for a in (
            "recursive_doubling",
            "rabenseifner",
            "pipelined_tree",
            "pipelined_ring",
            "hierarchical",
        )
    }
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
        assert (
            max(_sent("double_tree", p, n)) == 2 * n and max(_sent("pipelined_tree", p, n)) == 3 * n
        )


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
    """Every ``dplab.x.y`` the docs mention imports (a renamed module breaks this, not a user)."""
    import importlib

    names = set(re.findall(r"\bdplab(?:\.\w+)+", "\n".join(DOCS.values())))
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


@pytest.mark.parametrize("folder", FOLDERS)
def test_where_things_live_names_every_file(folder):
    """Each folder's README maps every module in it: a new file must find its place there."""
    doc = ROOT / folder / "README.md"
    section = doc.read_text().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    words = set(re.findall(r"[\w]+\.py|[\w]+/", section))
    missing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or path.name in words:
            continue
        missing.append(str(path.relative_to(ROOT)))
    for path in sorted(
        p for p in (ROOT / folder).rglob("*") if p.is_dir() and p.name != "__pycache__"
    ):
        if f"{path.name}/" not in words:
            missing.append(str(path.relative_to(ROOT)) + "/")
    assert not missing, f"{folder}/README.md's 'Where things live' does not mention {missing}"


def test_the_readme_shows_where_the_spine_lives():
    """From the README alone a learner finds the ring, the executor, the recipe and the reducer."""
    section = README.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    for path in ("algorithms/ring.py", "collectives.py", "train/sync.py", "train/buckets.py"):
        assert path in section and (ROOT / "reference" / path).exists(), path


def test_the_lessons_table_is_the_lessons():
    """Number, title, steps and needs of every lesson, as lessons/README.md lists them."""
    from dplab.lessons import lessons

    section = (ROOT / "lessons" / "README.md").read_text().split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    listed = [tuple(cell.strip() for cell in row.strip("|").split("|")[:4]) for row in rows]
    actual = [(str(les.number), les.title, str(len(les.steps)), ", ".join(les.needs) or "-")
              for les in lessons()]
    assert listed == actual


def test_the_coverage_table_is_complete_and_current():
    """Every idea has a step, and lessons/README.md's table is the one the lessons make."""
    from dplab.lessons.coverage import coverage, coverage_table

    assert [idea for idea, places in coverage().items() if not places] == []
    assert coverage_table() in (ROOT / "lessons" / "README.md").read_text()


def test_the_coverage_script_prints_that_table():
    """``python -m dplab.lessons.coverage``, as its docstring says, prints the README's table: every
    idea named in words (one added after the ``__main__`` guard printed as its bare key)."""
    printed = subprocess.run([sys.executable, "-m", "dplab.lessons.coverage"], capture_output=True,
                             text=True, check=True, timeout=120).stdout
    assert printed.strip() in (ROOT / "lessons" / "README.md").read_text()


def test_the_multi_host_lines_are_the_ones_the_hosts_tests_run():
    """The README prints lesson 12's launch lines, which Cluster builds as test_hosts_launchers runs
    them."""
    from dplab.lessons.l12_engines import launch_lines

    torch_lines, mpi_line = launch_lines()
    for argv in [*torch_lines, mpi_line]:
        assert " ".join(argv) in README, " ".join(argv)



SUITE_TIME = ROOT / "tests" / "suite_time.json"  # DPLAB_SUITE_RECORD=tests/suite_time.json pytest


def suite_times(records: dict[str, dict]) -> list[str]:
    """The README's sentence for each of its test commands recorded in ``tests/suite_time.json``
    (``DPLAB_SUITE_RECORD``, ``tests/conftest.py``). On c quiet cores a run takes at least its
    CPU seconds / c; the wall time measured is the load's as much as the suite's."""
    lines = []
    for command in ("pytest", HEAVY):
        if (r := records.get(command)) is None:
            continue
        cpu_min, (l0, l1) = r["cpu_s"] / 60, r["load_1min"]
        lines.append(f"`{command}`: {r['passed']:,} passed, {r['skipped']:,} skipped in "
                     f"{r['wall_s'] / 60:.0f} minutes at load {l0:.0f}-{l1:.0f} on {r['cores']} "
                     f"cores ({r['date']}), {cpu_min:.0f} CPU-minutes: at least "
                     f"{cpu_min / r['cores']:.0f} minutes on {r['cores']} quiet cores")
    return lines


def test_the_readmes_test_times_are_a_recorded_run():
    """Every time the README gives for its test commands is a run recorded in tests/suite_time.json
    (its date, load and cores said with it); without a record it gives none: none typed by hand."""
    import json

    records = json.loads(SUITE_TIME.read_text()) if SUITE_TIME.exists() else {}
    for command in ("pytest", HEAVY):
        r = records.get(command, {})
        assert r.get("failed", 0) == r.get("errors", 0) == 0, f"the recorded {command} failed"
    flat, sentences = " ".join(README.split()), suite_times(records)
    for sentence in sentences:
        assert sentence in flat, f"the README should say: {sentence}"
    section = flat.split("## Tests", 1)[1] + re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    said = len(re.findall(r"\b(minutes?|hours?)\b", section))
    assert said == sum(len(re.findall(r"\b(minutes?|hours?)\b", s)) for s in sentences), \
        "a test time typed by hand: record a run (SUITE_TIME) and paste python tests/test_readme.py"


if __name__ == "__main__":  # the README's sentences from the record, to paste
    import json

    print("\n".join(suite_times(json.loads(SUITE_TIME.read_text()))))
