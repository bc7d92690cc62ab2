"""The layers hold: imports run one way, and no import cycle hides anywhere.

The imports are read with ast from every file of reference/, backends/, viz/ and lessons/, at module
level and inside functions alike (an import deferred into a function is still a dependency), plus
``importlib.import_module("dplab....")``, ``importlib.util.find_spec("dplab....")`` and
``__import__("dplab....")`` with a literal name. Rules (issues 19 and 29):

- the folders form floors, ``reference < backends < viz < lessons``: no folder imports one above it
  (what lives above is found by entry points: the ``dplab app`` and ``dplab lesson`` commands,
  the app's Lessons page; see pyproject.toml);
- the executor (``reference/collectives.py``) reaches no cost model or autotuner;
- ``viz/`` reaches no command-line module (``backends/cli/``);
- no import cycles among dplab modules (strongly connected components, as
  ``../shared/tools/import_cycles.py`` counts them);
- ``from dplab.backends import allreduce, launch`` loads at most 25 dplab modules and neither MPI
  nor torch; ``import dplab.reference.collectives`` at most 8 (measured in a fresh interpreter);
  ``dplab train``'s modules load no simulator and read no cluster file.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"reference": "dplab.reference", "backends": "dplab.backends", "viz": "dplab.viz",
            "lessons": "dplab.lessons"}  # the floors, from the ground up
FLOORS = list(PACKAGES.values())
FINDERS = ("import_module", "find_spec", "__import__")  # calls that import (or locate) a name
COST_AND_TUNING = {
    f"dplab.reference.{m}" for m in ("auto", "costfit", "costmodel", "topology", "cost_cells")
}
CLI = "dplab.backends.cli"
# Pending on files other people are editing now; each test below names what is left.
PENDING_CYCLES: list[set[str]] = []
PENDING_VIZ_CLI: set[tuple[str, str]] = set()


@cache
def modules() -> dict[str, Path]:
    """Every dplab module -> its file (a package is its ``__init__.py``)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [
                p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"
            ]
            found[".".join([package, *parts])] = path
    return found


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import in ``path`` names, at any depth: ``from a.b import c`` names
    ``a.b`` and ``a.b.c`` (c may be a module); ``import_module("a.b")``, ``find_spec("a.b")`` or
    ``__import__("a.b")`` with a literal names ``a.b``."""
    return names_in(path.read_text(), str(path))


def names_in(source: str, path: str = "<source>") -> set[str]:
    """``imported_names`` of the code ``source``."""
    names = set()
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, (
                f"{path}:{node.lineno}: a relative import (dplab imports are absolute)"
            )
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in FINDERS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


@cache
def graph() -> dict[str, frozenset[str]]:
    """dplab module -> the dplab modules it imports (the tool's edges: names that are modules)."""
    mods = modules()
    return {
        m: frozenset(n for n in imported_names(f) if n in mods and n != m) for m, f in mods.items()
    }


def reachable(start: str) -> set[str]:
    """Every module ``start`` may load, through any chain of imports."""
    seen, todo = set(), [start]
    while todo:
        for w in graph()[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def import_cycles() -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[set[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    sccs.append(comp)
    return sccs


def test_the_graph_is_read_from_the_files():
    """The reader finds what it must: module- and function-level imports, and a literal
    import_module."""
    g = graph()
    assert "dplab.backends.fastpath.executor" in g["dplab.backends"]  # module level
    assert "dplab.backends.nn.ddp" in g["dplab.backends.cli.scaling_ddp"]  # inside a function
    assert "dplab.lessons.exercises" in g["dplab.lessons.terminal"]  # import_module("...")


def test_the_reader_sees_every_way_up():
    """What an upward import could hide behind is read: a deferred import, a relative-free
    ``from``, and the finders with a literal name (a name built at run time is an entry point's
    business, which the rule allows)."""
    code = ("def f():\n    from dplab.viz import app\n"
            "import importlib, importlib.util\n"
            "importlib.import_module('dplab.lessons.terminal')\n"
            "importlib.util.find_spec('dplab.lessons')\n"
            "__import__('dplab.viz.serve')\n")
    assert {"dplab.viz", "dplab.viz.app", "dplab.lessons.terminal", "dplab.lessons",
            "dplab.viz.serve"} <= names_in(code)


def _upward(folder: str) -> list[str]:
    """Each import in ``folder`` of a folder above it: 'file:name'."""
    above = tuple(FLOORS[FLOORS.index(folder) + 1:])
    return sorted(f"{modules()[m].relative_to(ROOT)} imports {n}"
                  for m in modules() if m == folder or m.startswith(folder + ".")
                  for n in imported_names(modules()[m])
                  if n in above or n.startswith(tuple(a + "." for a in above)))


@pytest.mark.parametrize("folder", FLOORS[:-1])
def test_no_folder_imports_one_above_it(folder):
    """reference < backends < viz < lessons: each floor imports only the floors below it."""
    leaks = _upward(folder)
    assert not leaks, leaks


def test_every_folder_is_a_floor():
    """The rule covers every folder that installs under dplab (tests stand above them all)."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders == set(PACKAGES), folders


def test_cycle_finder_finds_a_cycle(monkeypatch):
    """The finder itself: a -> b -> c -> a is one cycle; d, reached but leading nowhere, is none."""
    fake = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a", "d"}),
        "d": frozenset(),
    }
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: fake)
    assert import_cycles() == [{"a", "b", "c"}]


def test_no_new_import_cycles():
    """No cycle but the one still being untangled (see test_no_import_cycles)."""
    extra = [c for c in import_cycles() if c not in PENDING_CYCLES]
    assert not extra, f"import cycles: {[' <-> '.join(sorted(c)) for c in extra]}"


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"import cycles: {[' <-> '.join(sorted(c)) for c in cycles]}"


def test_the_short_import_is_plain():
    """``dplab.backends`` names what it imports, nothing resolved behind a module ``__getattr__``,
    and nothing it loads imports the package back."""
    import dplab.backends

    assert not hasattr(dplab.backends, "__getattr__")
    assert not any("dplab.backends" in graph()[m] for m in reachable("dplab.backends"))


def test_viz_imports_no_cli_module_beyond_the_pending_ones():
    """Nothing new: the only viz -> CLI edges are the bench ones listed in PENDING_VIZ_CLI."""
    edges = {(m, n) for m in modules() if m.startswith("dplab.viz") for n in graph()[m]
             if n == CLI or n.startswith(CLI + ".")}
    assert edges <= PENDING_VIZ_CLI, sorted(edges - PENDING_VIZ_CLI)


def test_viz_reaches_no_cli_module():
    """The app builds on runs, transports and the spine, never on the command line."""
    leaks = sorted(f"{m} -> {n}" for m in modules() if m.startswith("dplab.viz")
                   for n in reachable(m) if n == CLI or n.startswith(CLI + "."))
    assert not leaks, leaks


def test_executor_reaches_no_cost_model_or_autotuner():
    """``auto`` is resolved before the executor sees a schedule: the executor loads no pricing."""
    found = sorted(reachable("dplab.reference.collectives") & COST_AND_TUNING)
    assert not found, f"reference/collectives.py reaches {found}"


def _loaded(code: str) -> dict[str, list[str]]:
    """The dplab modules and the engines (torch, mpi4py) a fresh interpreter holds after
    ``code``."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps({'dplab': sorted(m for m in sys.modules if m.split('.')[0] == 'dplab'),"
        " 'engines': sorted(m for m in ('torch', 'mpi4py') if m in sys.modules)}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_short_import_stays_small():
    """A learner's first import starts no trainer, CLI, MPI or torch: they load when used."""
    loaded = _loaded("from dplab.backends import allreduce, launch")
    assert len(loaded["dplab"]) <= 25, loaded["dplab"]
    assert not loaded["engines"], loaded["engines"]
    assert not [
        m
        for m in loaded["dplab"]
        if m.startswith(("dplab.backends.cli", "dplab.backends.runs", "dplab.backends.torchdist"))
    ]


def test_launch_loads_no_engine_until_used():
    loaded = _loaded("import dplab.backends.launch.world")
    assert not loaded["engines"], loaded["engines"]
    assert "dplab.backends.mpi.comm" not in loaded["dplab"]


def test_the_local_train_path_loads_no_simulator_and_reads_no_cluster_file():
    """``dplab train`` on the local backend: the simulator loads for a sim run only, and a preset's
    cluster file is read when its topology is first asked for (issue 29)."""
    loaded = _loaded("import dplab.backends.cli.commands, dplab.backends.runs.run\n"
                     "import dplab.reference.topology\n"
                     "from dplab.reference.cluster import _preset\n"
                     "assert _preset.cache_info().currsize == 0, 'a cluster file was read'")
    assert not [m for m in loaded["dplab"] if m.startswith("dplab.backends.sim")], loaded["dplab"]


def test_the_executor_import_stays_small():
    loaded = _loaded("import dplab.reference.collectives")
    assert len(loaded["dplab"]) <= 8, loaded["dplab"]
