"""The command line's tables and progress bar on rich: plain and stable when piped, styled in a
terminal."""

from __future__ import annotations

import io
import re

import pytest

from dplab.backends.cli import table
from dplab.backends.cli.table import Progress, format_table, styled

SGR = re.compile(r"\x1b\[[0-9;]*m")
ROWS = [{"backend": "local", "world_size": 4, "ranks_identical": True, "vs_native": None},
        {"backend": "mpi", "world_size": 16, "ranks_identical": False, "vs_native": 0.5}]
COLUMNS = ["backend", "world_size", "ranks_identical", "vs_native"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_table_is_the_documented_layout():
    assert format_table(ROWS, COLUMNS, colour=False).splitlines() == [
        "backend  world_size  ranks_identical  vs_native",
        "-------  ----------  ---------------  ---------",
        "  local           4             True          -",
        "    mpi          16            False        0.5"]


def test_a_wide_table_is_never_wrapped():
    wide = [{f"column_{i}": 123456.0 for i in range(12)}]
    lines = format_table(wide, list(wide[0]), colour=False).splitlines()
    assert len(lines) == 3 and len(lines[0]) == len(lines[2]) == 12 * 8 + 2 * 11 + 2 > 80


def test_colour_adds_style_and_nothing_else():
    coloured = format_table(ROWS, COLUMNS, colour=True)
    assert "\x1b[1m" in coloured                                     # bold header
    assert re.search(r"\x1b\[32m *True", coloured) and re.search(r"\x1b\[1;31m *False", coloured)
    assert SGR.sub("", coloured) == format_table(ROWS, COLUMNS, colour=False)


def test_colour_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert styled(_Tty()) and not styled(io.StringIO())
    # rich's override does not reach us
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not styled(io.StringIO())
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert "\x1b" not in format_table(ROWS, COLUMNS)                 # default: stdout decides
    monkeypatch.setenv("NO_COLOR", "1")
    assert not styled(_Tty())
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert not styled(_Tty())


def test_progress_is_silent_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    p = Progress(3)
    p.step("a")
    p.close()
    p.close()
    assert not p.live and err.getvalue() == ""


@pytest.mark.parametrize("no_color", ["", "1"])
def test_progress_on_a_terminal_counts_shows_an_eta_and_gives_the_cursor_back(
    monkeypatch, no_color
):
    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("NO_COLOR", no_color)
    unregistered = []
    monkeypatch.setattr(table.atexit, "unregister", unregistered.append)
    p = Progress(2)
    p.step("local world size 2")
    p._bar.refresh()
    p.step("local world size 4")
    p._bar.refresh()
    p.close()
    text = err.getvalue()
    assert "1/2" in text and "2/2" in text and "local world size 4" in text and "eta" in text
    # the hidden cursor is shown again
    assert text.rindex("\x1b[?25h") > text.index("\x1b[?25l")
    assert unregistered == [p.close]                                 # closed: nothing left for exit
    assert bool(SGR.search(text)) == (no_color == "")
