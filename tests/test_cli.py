"""The dplab command line, as a user types it: tables, JSON rows, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dplab.backends.cli.commands import main


def test_compare_default_grid_shows_equivalence(tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert main(["compare", "--steps", "10", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "max_abs_diff_vs_single" in table
    rows = json.loads(out.read_text())["rows"]
    grid = {(r["algorithm"], r["world_size"]) for r in rows}
    assert grid == {(a, p) for a in ("naive", "ring", "tree", "native") for p in (1, 2, 3, 4)}
    for r in rows:
        assert r["max_abs_diff_vs_single"] < 1e-12, r
        assert r["ranks_identical"] is True
        assert r["final_loss"] == pytest.approx(rows[0]["final_loss"], rel=1e-10)


def test_train_writes_trace_and_chrome_trace(tmp_path, capsys):
    trace = tmp_path / "run.json"
    rc = main(["train", "--world-size", "3", "--algorithm", "tree", "--steps", "3",
               "--dataset", "classification", "--hidden", "8", "--trace", str(trace)])
    assert rc == 0
    doc = json.loads(trace.read_text())
    kinds = {e["kind"] for e in doc["events"]}
    assert {"forward", "backward", "bucket", "reduce", "copy", "send", "optimizer"} <= kinds
    assert {e["rank"] for e in doc["events"]} == {0, 1, 2}
    assert doc["meta"]["row"]["max_abs_diff_vs_single"] < 1e-12
    chrome = json.loads(trace.with_suffix(".chrome.json").read_text())
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(doc["events"]) and all(e["dur"] >= 0 for e in spans)


def test_bench_rows_have_busbw_and_memcpy_ceiling(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--world-sizes", "2,3", "--sizes", "4K,64K", "--algorithms", "ring,tree",
               "--target-seconds", "0.01", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["algorithm"] != "memcpy"]
    assert {(r["algorithm"], r["world_size"], r["bytes"]) for r in ours} == {
        (a, p, b) for a in ("ring", "tree") for p in (2, 3) for b in (4096, 65536)}
    for r in ours:
        p = r["world_size"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (p - 1) / p, rel=1e-9)
        assert r["staged_bytes"] == 0  # buffers live in shared memory: no staging copies
    # One memcpy row per run (backend x world size), printed, and the one that run divides by.
    ceiling = {(r["world_size"], r["bytes"]): r for r in rows if r["algorithm"] == "memcpy"}
    assert set(ceiling) == {(p, b) for p in (2, 3) for b in (4096, 65536)}
    assert all(r["backend"] == "local" and r["busbw_gbps"] > 0 and r["vs_memcpy"] == 1
               for r in ceiling.values())
    for r in ours:
        own = ceiling[(r["world_size"], r["bytes"])]["busbw_gbps"]
        assert r["vs_memcpy"] == pytest.approx(r["busbw_gbps"] / own, rel=1e-12)
        assert r["vs_native"] is None  # no native in --algorithms: no yardstick, not a NaN


@pytest.mark.parametrize("argv, message", [
    (["train", "--world-size", "0"], "world_size must be a positive integer"),
    (["train", "--algorithm", "bogus"], "unknown algorithm 'bogus'"),
    (["train", "--backend", "nccl"], "unknown backend 'nccl'"),
    (["train", "--mode", "async", "--world-size", "1"], "world_size >= 2"),
    (["train", "--mode", "async", "--staleness", "-1"], "staleness must be >= 0"),
    (["train", "--global-batch", "0"], "global_batch must be >= 1"),
    (["train", "--hidden", "x"], "bad list"),
    (["train", "--steps", "ten"], "invalid int value"),
    (["bench", "--sizes", "4Q"], "invalid"),
    (["bench", "--reps", "0"], "--reps >= 1"),
    (["bench", "--worlds", "0"], "must be an integer >= 1, got 0"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_one_line_exit_2(cli_here, argv, message):
    proc = cli_here(*argv)  # main in this process (conftest): a world started would fail the test
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["train", "--world-size", "0"], "world_size must be a positive integer"),  # dplab's check
    (["frobnicate"], "invalid choice"),  # argparse's
])
def test_bad_arguments_one_line_exit_2_from_the_module_as_run(argv, message):
    """The cases above as a real process: ``python -m`` exits 2 with that one line only."""
    proc = subprocess.run([sys.executable, "-m", "dplab.backends.cli", *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_compare_refuses_a_bad_world_size_before_any_rank_starts(cli_here):
    proc = cli_here("compare", "--world-sizes", "1,0")
    assert proc.returncode == 2 and "world_size must be a positive integer" in proc.stderr


def test_bad_config_is_rejected_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as stop:  # caught while parsing, before any rank starts
        main(
            [
                "train",
                "--world-size",
                "2",
                "--steps",
                "1",
                "--dtype",
                "float32",
                "--bucket-cap-mb",
                "-1",
            ]
        )
    assert stop.value.code == 2
    assert "--bucket-cap-mb: must be a finite number > 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("staleness", ["0", "2", "inf"])
def test_async_train_row_replays_exactly(tmp_path, capsys, staleness):
    out = tmp_path / "async.json"
    rc = main(["train", "--mode", "async", "--world-size", "4", "--staleness", staleness,
               "--steps", "6", "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "async" and row["algorithm"] == f"ps s={staleness}"
    assert row["replay_exact"] is True
    assert row["final_loss"] > 0 and row["max_abs_diff_vs_single"] > 0  # async is not sync
    if staleness != "inf":
        # Between a worker's pull and its push, each of the other W-1 workers can push at most
        # the clocks c-s .. c+s (the gate holds everyone within s of the slowest): 2s+1 each.
        workers, s = 3, int(staleness)
        assert 0 <= row["max_delay"] <= (workers - 1) * (2 * s + 1)
