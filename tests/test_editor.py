"""An editor can follow the imports: ``dplab.*`` resolves statically, as a newcomer's editor reads.

Editors and type checkers (jedi, pyright, Pylance, PyCharm) find modules on the paths that
``.pth`` files list; they do not run an import hook. The folders install under ``dplab`` through
``src/dplab/``, whose entries link to them, so the editable install is one plain ``.pth`` line
(``<checkout>/src``), and "go to definition" on ``dplab.reference.collectives.allreduce`` lands in
``reference/collectives.py``, from a user's script anywhere and from a test in the checkout.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from dplab.reference import collectives

jedi = pytest.importorskip("jedi")

ROOT = Path(__file__).resolve().parents[1]
CODE = "from dplab.reference.collectives import allreduce\nallreduce\n"


def _definition(script: Path) -> tuple[Path, int]:
    """Where jedi, in this interpreter's environment as an editor would start it, sends
    "go to definition" on the name in line 2 of ``CODE`` written at ``script``."""
    environment = jedi.create_environment(sys.executable, safe=False)
    found = jedi.Script(CODE, path=script, environment=environment).goto(2, 3, follow_imports=True)
    assert len(found) == 1, f"jedi found {found} for allreduce from {script}"
    return Path(found[0].module_path).resolve(), found[0].line


@pytest.mark.parametrize("where", ["a user's script", "a test"])
def test_go_to_definition_finds_the_executor(tmp_path: Path, where: str) -> None:
    mine = ROOT / "tests" / "test_mine.py"
    script = tmp_path / "train.py" if where == "a user's script" else mine
    path, line = _definition(script)  # the script need not exist: an editor's unsaved buffer
    assert path == Path(collectives.__file__).resolve()
    assert line == inspect.getsourcelines(collectives.allreduce)[1]


def test_the_link_tree_is_the_four_folders() -> None:
    links = {p.name: p for p in (ROOT / "src" / "dplab").iterdir()}
    assert sorted(links) == ["backends", "lessons", "reference", "viz"]
    for name, link in links.items():
        assert link.is_symlink() and link.resolve() == ROOT / name, name
