"""Code lines fit 100 columns in the folders brought there (issue 29), before ruff's own limit is.

pyproject's ruff line-length stays 110 until every folder fits; this test keeps the folders that
do from growing back (a line of one long word, a URL, is let through, as ruff's E501 does). Add a
folder to FOLDERS once it fits; drop the test when pyproject says 100.

    pytest tests/test_line_length.py -q
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["reference", "viz"]
LIMIT = 100


def test_every_line_of_these_folders_fits_100_columns() -> None:
    too_long = [f"{path.relative_to(ROOT)}:{i}: {len(line)} columns"
                for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if len(line) > LIMIT and " " in line.strip()]  # one long word (a URL): as ruff
    assert not too_long, (f"{len(too_long)} lines are longer than {LIMIT} columns; wrap them "
                          "(ruff format --line-length 100 --range L:1-L:999 FILE wraps the "
                          "statement on line L):\n" + "\n".join(too_long[:20]))
