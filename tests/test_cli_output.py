"""What a person reads: numbers with sensible digits, and a pipe into ``head`` that ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dplab.backends.cli.table import format_number, format_table


@pytest.mark.parametrize("value, shown", [
    (14380.25, "14,380"),            # samples/s: not 1.438e+04
    (1_234_567.0, "1,234,567"),
    (999.96, "1,000"),
    (345.21, "345.2"),
    (3.04, "3.04"),
    (0.0797123, "0.07971"),
    (0.00064, "0.00064"),            # a small ratio stays readable
    (2.220446049250313e-16, "2.220e-16"),  # a float64 rounding gap: here scientific helps
    (0.0, "0"),
    (1048576, "1,048,576"),          # bytes
    (4, "4"),
    (True, "True"),
    (None, "-"),
    ("ring", "ring"),
])
def test_numbers_as_a_person_reads_them(value, shown):
    assert format_number(value) == shown


def test_table_right_aligns_formatted_cells():
    text = format_table([{"a": 14380.25, "b": 2.2e-16}, {"a": 3.5, "b": 0.0}], ["a", "b"])
    assert text.splitlines() == ["     a          b", "------  ---------", "14,380  2.200e-16",
                                 "   3.5          0"]


def test_train_table_is_readable_and_json_keeps_full_values(tmp_path, capsys):
    from dplab.backends.cli.commands import main

    out = tmp_path / "rows.json"
    assert main(["train", "--world-size", "2", "--steps", "5", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "e+" not in table
    (row,) = json.loads(out.read_text())["rows"]
    assert isinstance(row["wall_s"], float) and isinstance(row["final_loss"], float)
    assert format_number(row["final_loss"]) in table
    assert repr(row["final_loss"]) not in table  # the table rounds; the JSON does not
    assert len(repr(row["final_loss"])) > len(format_number(row["final_loss"]))


def test_reader_that_leaves_ends_the_output_quietly(tmp_path):
    """``dplab train | head -1``: the reader is gone before we print;
    no BrokenPipeError traceback."""
    out = tmp_path / "rows.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dplab.backends.cli",
            "train",
            "--world-size",
            "2",
            "--steps",
            "3",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # as head does once it has its lines: every write now gets EPIPE
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == 0
    # the work and --json still done
    assert json.loads(out.read_text())["rows"][0]["world_size"] == 2


def test_compare_piped_into_head_prints_three_lines_and_no_traceback():
    proc = subprocess.run(f"{sys.executable} -m dplab.backends.cli compare --steps 2 --world-sizes "
                          "1,2 | head -3", shell=True, capture_output=True, text=True, timeout=120)
    assert len(proc.stdout.splitlines()) == 3 and proc.stdout.startswith("backend")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
