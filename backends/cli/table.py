"""Tables and a progress bar for the command line, drawn with rich.

    print(format_table(rows, ["backend", "world_size", "final_loss"]))   # what every command prints
    progress = Progress(len(cells)); ...; progress.step("local p=4"); progress.close()

Piped (``dplab compare | head``, the tests, ``NO_COLOR=1``) a table is plain text that scripts can
split on whitespace: a header, a row of dashes, right-aligned cells two spaces apart, written
without rich (a pipe needs no terminal library, and the command starts sooner without it). In a
terminal rich draws the same layout with a bold header and coloured booleans. The progress bar
(with an ETA) is drawn on stderr only when stderr is a terminal, so piped output never holds
cursor codes.
"""

from __future__ import annotations

import atexit
import io
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["format_table", "format_number", "Progress", "styled"]


def format_number(v: Any) -> str:
    """A value as a person reads it in a table; the JSON rows keep the full value.

    Integers get thousands separators (1,048,576). Floats: 1,000 and up are rounded to
    whole numbers with separators (14,380 samples/s, not 1.438e+04); between 0.0001 and
    1,000, four significant digits (0.07971, 345.2, 0.00064); below 0.0001 scientific
    notation, where it helps (a max_abs_diff of 2.220e-16). None (no value: a missing yardstick) is
    '-'.
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


def styled(stream: TextIO | None = None) -> bool:
    """Colour for ``stream`` (default stdout): a terminal, not ``TERM=dumb``, and no ``NO_COLOR``.

    Decided here rather than by rich's own detection so that ``FORCE_COLOR`` or a notebook can
    never put escape codes into output a script or a test parses.
    """
    return _terminal(stream or sys.stdout) and not os.environ.get("NO_COLOR")


def _terminal(stream: TextIO) -> bool:
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


_CELL_STYLE = {"True": "green", "False": "bold red", "-": "dim"}


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                 colour: bool | None = None) -> str:
    """The rows as a table, one line per row (never wrapped: a wide table stays one line per row).

    Args:
        rows: the command's rows; a column a row lacks shows as empty.
        columns: the keys to show, in order, each the header of its column.
        colour: a bold header and coloured booleans (drawn by rich); None: when stdout is a
            terminal (``styled``).

    Returns:
        The lines, joined. Plain text is stable: the layout the tests and the README show.
    """
    colour = styled() if colour is None else colour
    lines = [list(columns), *([format_number(r.get(c, "")) for c in columns] for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    lines.insert(1, ["-" * w for w in widths])
    if colour:
        return _rich_table(lines, widths)
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)).rstrip()
                     for line in lines if columns)


def _rich_table(lines: list[list[str]], widths: list[int]) -> str:
    """The table as rich draws it on a terminal, in colour.

    Args:
        lines: the header, the dashes, then the rows, each a list of cell texts.
        widths: each column's width, its widest cell's.

    Returns:
        The lines, joined, with a bold header, dim dashes and coloured booleans.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, collapse_padding=False,
                  header_style="bold", show_header=True)
    for c, w in zip(lines[0], widths):
        table.add_column(c, justify="right", no_wrap=True, min_width=w, max_width=w)
    table.add_row(*(Text(v, style="dim") for v in lines[1]))
    for row in lines[2:]:
        table.add_row(*(Text(v, style=_CELL_STYLE.get(v, "")) for v in row))
    out = io.StringIO()
    console = Console(file=out, width=max(sum(widths) + 2 * max(len(widths) - 1, 0), 1),
                      force_terminal=True, color_system="auto", highlight=False, emoji=False,
                      legacy_windows=False)
    console.print(table, crop=False, overflow="ignore", soft_wrap=False)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


class Progress:
    """A rich progress bar on stderr (done/total, elapsed, ETA, label); silent when stderr is not a
    terminal. ``step`` after each piece of work, ``close`` at the end (also run at exit, so an error
    that skips it cannot leave the terminal's cursor hidden)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self.live = _terminal(sys.stderr)  # NO_COLOR takes the colour away, not the bar
        self._bar: Any = None
        if self.live:
            import rich.progress as rp
            from rich.console import Console

            console = Console(file=sys.stderr, no_color=bool(os.environ.get("NO_COLOR")))
            self._bar = rp.Progress(rp.BarColumn(bar_width=width), rp.MofNCompleteColumn(),
                                      rp.TimeElapsedColumn(), rp.TextColumn("eta"),
                                    rp.TimeRemainingColumn(),
                                      rp.TextColumn("{task.description}"), console=console,
                                    transient=True,
                                      redirect_stdout=False, redirect_stderr=False,
                                    refresh_per_second=4)
            self._task = self._bar.add_task("", total=max(total, 1))
            self._bar.start()
            atexit.register(self.close)

    def step(self, label: str = "") -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label[:40])

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.stop()
            atexit.unregister(self.close)
