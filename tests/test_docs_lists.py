"""Every all-reduce algorithm the code accepts is named wherever the docs list them.

The registry (``dplab.reference.algorithms.ALGORITHMS``: the schedules and ``native``) and ``auto``
(``has_schedule``: accepted wherever an all-reduce is) are the truth; a list typed by hand that
forgets one tells a learner it does not exist.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import dplab.reference
from dplab.backends.cli.args import build_parser
from dplab.reference.algorithms import ALGORITHMS, ALLREDUCE, has_schedule

ROOT = Path(__file__).resolve().parents[1]
NAMES = (*ALGORITHMS, "auto")


def _named(name: str, text: str) -> bool:
    """``name`` as a word of its own: "ring" in "pipelined_ring" does not count."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def _subcommand_help(command: str, dest: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in sub.choices[command]._actions if a.dest == dest)


def test_the_names_are_the_registry():
    assert set(ALLREDUCE) < set(ALGORITHMS) and "native" in ALGORITHMS
    assert all(has_schedule(name) for name in NAMES)
    assert len(NAMES) == len(set(NAMES)) >= 12


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_map_names_it(name):
    assert _named(name, dplab.reference.__doc__), (
        f"reference/__init__.py's map does not name {name!r}"
    )


@pytest.mark.parametrize(("command", "dest"), [("train", "algorithm"), ("compare", "algorithms"),
                                               ("bench", "algorithms")])
def test_the_help_names_every_algorithm(command, dest):
    text = _subcommand_help(command, dest)
    assert [n for n in NAMES if not _named(n, text)] == [], f"dplab {command} --help, --{dest}"


def test_the_readme_algorithm_list_names_every_algorithm():
    section = (ROOT / "README.md").read_text().split("\n## Algorithms", 1)[1].split("\n## ", 1)[0]
    listed = section.strip().split("\n\n", 1)[0]  # the paragraph that lists them, before the table
    assert [n for n in NAMES if f"`{n}`" not in listed] == []
