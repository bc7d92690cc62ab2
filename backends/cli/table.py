"""Plain-text tables and a progress bar for the command line (no dependencies)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["format_table", "Progress"]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


class Progress:
    """``[#####.....] 5/10 label`` on stderr, redrawn in place; silent when stderr is not a terminal."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self.live = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done += 1
        if self.live:
            fill = self.width * self.done // max(self.total, 1)
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} "
                             f"{elapsed:5.1f}s {label:<40.40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.live:
            sys.stderr.write("\r" + " " * (self.width + 60) + "\r")
            sys.stderr.flush()
