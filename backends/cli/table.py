"""Plain-text tables and a progress bar for the command line (no dependencies)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["format_table", "format_number", "Progress"]


def format_number(v: Any) -> str:
    """A value as a person reads it in a table; the JSON rows keep the full value.

    Integers get thousands separators (1,048,576). Floats: 1,000 and up are rounded to
    whole numbers with separators (14,380 samples/s, not 1.438e+04); between 0.0001 and
    1,000, four significant digits (0.07971, 345.2, 0.00064); below 0.0001 scientific
    notation, where it helps (a max_abs_diff of 2.220e-16). None (no value: a missing yardstick) is '-'.
    """
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    if abs(v) >= 999.95:  # what .4g would round up to 1000 is shown as 1,000 too
        return f"{v:,.0f}"
    if abs(v) >= 1e-4:
        return f"{v:.4g}"
    return f"{v:.3e}"


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[format_number(r.get(c, "")) for c in columns] for r in rows]
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
