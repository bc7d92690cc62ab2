"""Code lines fit 100 columns (issue 29), as pyproject's ruff line-length says, so the suite keeps
it too; a lesson's prose (lessons/lNN_*.py) wraps as it likes (its shown code is held to 80 by
tests/test_lessons.py). As ruff's E501 does, a line of one long word (a URL) is let through, a
trailing ``# noqa`` is not counted, and ``# noqa: E501`` waives the line.

    pytest tests/test_line_length.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["reference", "backends", "viz", "lessons", "tests"]
LIMIT = 100
PROSE = re.compile(r"l\d\d_\w+\.py")  # the lessons' text
NOQA = re.compile(r"\s*# noqa.*$")  # ruff measures a line without its pragma comment
WAIVED = re.compile(r"# noqa(: [A-Z0-9, ]*E501\b|$)")  # ruff's own waiver of E501


def test_every_line_of_these_folders_fits_100_columns() -> None:
    too_long = [f"{path.relative_to(ROOT)}:{i}: {len(line)} columns"
                for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
                if not PROSE.fullmatch(path.name) or path.parent.name != "lessons"
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if len(NOQA.sub("", line)) > LIMIT and " " in line.strip()  # a URL: as ruff
                and not WAIVED.search(line)]
    assert not too_long, (f"{len(too_long)} lines are longer than {LIMIT} columns; wrap them "
                          "(ruff format --line-length 100 --range L:1-L:999 FILE wraps the "
                          "statement on line L):\n" + "\n".join(too_long[:20]))
