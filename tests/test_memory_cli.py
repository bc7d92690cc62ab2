"""``dplab memory``: the table and JSON rows are the closed forms;
bad input is one line and exit 2."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from dplab.backends.cli.args import build_parser
from dplab.backends.cli.commands import main
from dplab.backends.cli.memory import MEMORY_COLUMNS, parse_params
from dplab.reference.zero.memory import model_state_bytes


def _table(text: str) -> list[dict[str, str]]:
    """The table's rows as column -> cell text (the lines after the header's dashes)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----"))
    header = lines[start - 1].split()
    assert header == MEMORY_COLUMNS
    return [dict(zip(header, line.split())) for line in lines[start + 1:] if line.strip()]


def test_the_papers_figure_1_as_a_table(capsys):
    assert main(["memory", "--params", "7.5B", "--world-sizes", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7,500,000,000 parameters, adam, mixed: 2 + 2 + 12 = 16 bytes per "
                          "parameter")
    rows = _table(out)
    assert [(r["stage"], r["world_size"]) for r in rows] == [(s, "64") for s in "0123"]
    assert [r["total_gb"] for r in rows] == ["120", "31.41", "16.64", "1.875"]
    assert [r["reduction"] for r in rows] == ["1", "3.821", "7.211", "64"]
    assert rows[1]["optimizer_gb"] == "1.406" and rows[2]["grads_gb"] == "0.2344"
    assert rows[3]["params_gb"] == "0.2344" and rows[0]["params_gb"] == "15"


def test_defaults_are_7b_adam_mixed_on_1_8_64_ranks(capsys):
    """The issue's example: 14 GB of fp16 weights, 112 GB with mixed-precision Adam, every stage x
    N."""
    assert main(["memory"]) == 0
    rows = _table(capsys.readouterr().out)
    grid = [(n, s) for n in (1, 8, 64) for s in range(4)]
    assert [(int(r["world_size"]), int(r["stage"])) for r in rows] == grid
    # one rank: nothing to shard
    assert {r["total_gb"] for r in rows if r["world_size"] == "1"} == {"112"}
    assert {r["params_gb"] for r in rows if r["stage"] != "3"} == {"14"}
    eight = {r["stage"]: r["total_gb"] for r in rows if r["world_size"] == "8"}
    assert eight == {"0": "112", "1": "38.5", "2": "26.25", "3": "14"}


def test_json_rows_are_the_formulas_at_full_precision(tmp_path, capsys):
    out = tmp_path / "mem.json"
    argv = ["memory", "--params", "350M", "--optimizer", "momentum", "--precision", "float32",
            "--world-sizes", "3,5", "--stages", "0,2", "--json", str(out)]
    assert main(argv) == 0
    assert f"rows written to {out}" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"] == "memory" and doc["meta"]["argv"] == argv
    rows = doc["rows"]
    assert [(r["world_size"], r["stage"]) for r in rows] == [(3, 0), (3, 2), (5, 0), (5, 2)]
    for r in rows:
        assert r["num_params"] == 350_000_000
        assert (r["param_bytes"], r["grad_bytes"], r["state_bytes"]) == (4, 4, 4)
        b = model_state_bytes(
            350e6, r["stage"], r["world_size"], param_bytes=4, grad_bytes=4, state_bytes=4
        )
        assert (r["params_bytes"], r["grads_bytes"], r["optimizer_bytes"]) == (
            b.params,
            b.grads,
            b.optimizer,
        )
        assert r["total_gb"] == b.total / 1e9
    # stage 2 on 3 ranks by hand: 4 x 350e6 weights + (4 + 4) x 350e6 / 3 = 1.4e9 + 0.9333e9
    assert rows[1]["total_bytes"] == pytest.approx(1.4e9 + 2.8e9 / 3, rel=1e-15)
    assert rows[1]["reduction"] == pytest.approx(4.2e9 / (1.4e9 + 2.8e9 / 3), rel=1e-15)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("7B", 7_000_000_000),
        ("7b", 7_000_000_000),
        ("1.3e9", 1_300_000_000),
        ("1.3B", 1_300_000_000),
        ("350M", 350_000_000),
        ("125K", 125_000),
        ("1.5T", 1_500_000_000_000),
        ("7_000", 7000),
        ("42", 42),
        ("0.5K", 500),
        (" 2G ", 2_000_000_000),
    ],
)
def test_parameter_counts(text, count):
    assert parse_params(text) == count


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("7X", "invalid parameter count '7X'"),
        ("", "invalid parameter count"),
        ("B", "invalid parameter count"),
        ("1e", "invalid parameter count"),
        ("sNaN", "invalid parameter count"),
        ("0", "whole number >= 1"),
        ("-7B", "whole number >= 1"),
        ("1.5", "whole number >= 1"),
        ("nan", "whole number >= 1"),
        ("inf", "whole number >= 1"),
        ("1e20", "at most 1000T"),
    ],
)
def test_bad_parameter_counts(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_params(text)


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "7X"], "argument --params: invalid parameter count '7X'"),
    (["--world-sizes", "0"], "argument --world-sizes: world size 0: must be an integer >= 1"),
    (["--world-sizes", "8,x"], "argument --world-sizes: bad list '8,x'"),
    (["--stages", "4"], "argument --stages: stage 4: must be one of 0, 1, 2, 3"),
    (["--stages", ","], "argument --stages: empty list"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--optimizer", "adagrad"], "argument --optimizer: invalid choice: 'adagrad'"),
])
def test_bad_arguments_one_line_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dplab memory: error: ") and message in err


def test_unwritable_json_is_one_line_and_nothing_printed(tmp_path, capsys):
    assert main(["memory", "--json", str(tmp_path / "no" / "mem.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "directory" in err and "does not exist" in err


def test_the_installed_command_exits_2_on_bad_input():
    proc = subprocess.run(
        [sys.executable, "-m", "dplab.backends.cli", "memory", "--params", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "invalid parameter count 'lots'" in proc.stderr


def test_every_option_is_explained_with_its_default():
    sub = next(a for a in build_parser()._actions if hasattr(a, "_name_parser_map")).choices[
        "memory"
    ]
    text = re.sub(r"\s+", " ", sub.format_help())
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert [a.option_strings[0] for a in options] == ["--params", "--optimizer", "--precision",
                                                      "--world-sizes", "--stages", "--json"]
    for a in options:
        assert a.help and len(a.help) > 20
    for shown in ["(default: 7B)", "(default: adam)", "(default: mixed)", "(default: 1,8,64)",
                  "(default: 0,1,2,3)", "(default: not written)", "reduction stage 0's total / "
                                                                  "this total"]:
        assert shown in text, shown


def test_a_reader_that_leaves_ends_the_output_quietly():
    """``dplab memory ... | head -1``: 12,000 rows overflow the pipe;
    no BrokenPipeError traceback, exit 0."""
    sizes = ",".join(map(str, range(1, 3001)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dplab.backends.cli", "memory", "--world-sizes", sizes],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline().startswith(b"7,000,000,000 parameters")
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""
