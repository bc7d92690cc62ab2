"""The sim backend on the command line: the same command gives the same trace, byte for byte,
beside a CPU hog or not; every row names its cluster; bad input is one line and exit 2 before any
rank starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dplab.backends.cli.commands import main

TRAIN = [
    "train",
    "--backend",
    "sim",
    "--cluster",
    "dgx-h100x2",
    "--world-size",
    "10",  # two nodes (8 + 2): both links, and a world a tenth the cost of 16 x 4 steps
    "--steps",
    "2",
]


def _train(tmp_path, name: str) -> tuple[bytes, bytes, dict]:
    trace, rows = tmp_path / f"{name}.json", tmp_path / f"{name}-rows.json"
    assert main([*TRAIN, "--trace", str(trace), "--json", str(rows)]) == 0
    row = json.loads(rows.read_text())["rows"][0]
    return trace.read_bytes(), trace.with_suffix(".chrome.json").read_bytes(), row


def test_the_same_command_gives_the_same_trace_beside_a_cpu_hog(tmp_path, capsys):
    quiet = _train(tmp_path, "quiet")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = _train(tmp_path, "busy")
    finally:
        hog.kill()
        hog.wait()
    assert quiet == busy  # the trace, its Perfetto file and the row, byte for byte
    row = quiet[2]
    assert row["cluster"] == "dgx-h100x2" and row["clock"] == "simulated" and row["step_ms"] > 0
    assert row["max_abs_diff_vs_single"] < 1e-12 and row["ranks_identical"]
    doc = json.loads(quiet[0])
    assert doc["meta"]["clock"] == "simulated" and doc["meta"]["cluster"] == "dgx-h100x2"
    assert {e["rank"] for e in doc["events"]} == set(range(10))
    out = capsys.readouterr().out
    assert "dgx-h100x2" in out and "simulated time, not measured" in out and "step_ms" in out


def test_bench_rows_come_from_the_schedules_and_name_their_cluster(tmp_path):
    rows_file = tmp_path / "bench.json"
    argv = [
        "bench",
        "--backends",
        "sim",
        "--cluster",
        "dgx-h100",
        "--world-sizes",
        "8",
        "--sizes",
        "1G",
        "--algorithms",
        "ring,native",
        "--json",
        str(rows_file),
    ]
    assert main(argv) == 0
    rows = {r["algorithm"]: r for r in json.loads(rows_file.read_text())["rows"]}
    assert all(r["cluster"] == "dgx-h100" and r["clock"] == "simulated" for r in rows.values())
    assert (
        300 < rows["ring"]["busbw_gbps"] < 450
    )  # NVLink4's 450 GB/s each way, less alpha and gamma
    assert rows["memcpy"]["busbw_gbps"] == pytest.approx(3350 / 2)  # a copy reads and writes HBM3


def _bad_file(tmp_path, **links) -> str:
    intra = {"alpha_us": 2, "bandwidth_gb_s": 100} | links
    doc = {
        "name": "bad",
        "nodes": 1,
        "ranks_per_node": 4,
        "device": {"tflop_s": 10, "memory_gb": 16, "memory_gb_s": 500},
        "links": {"intra": {k: v for k, v in intra.items() if v is not None}},
    }
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--cluster", "dgx-h200x7"], "unknown cluster 'dgx-h200x7'"),
        (["--cluster", "dgx-h100x0"], "takes 1 to 128 nodes"),
        (["--cluster", "dgx-h100", "--world-size", "9"], "holds 8 ranks"),
        (
            ["--cluster", "dgx-h100", "--hidden", "200000,200000", "--world-size", "8"],
            "GB too many",
        ),
    ],
)
def test_bad_sim_input_is_one_line_before_any_rank_starts(cli_here, argv, words):
    done = cli_here("train", "--backend", "sim", *argv)
    assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, (
        done.stderr
    )


@pytest.mark.parametrize(
    "bandwidth,words",
    [(-5, "bandwidth_gb_s is -5"), (0, "bandwidth_gb_s is 0"), (None, "bandwidth_gb_s is missing")],
)
def test_a_cluster_file_with_a_bad_bandwidth_is_refused(cli_here, tmp_path, bandwidth, words):
    path = _bad_file(tmp_path, bandwidth_gb_s=bandwidth)
    for argv in (
        ["train", "--backend", "sim", "--world-size", "2"],
        ["bench", "--backends", "sim", "--world-sizes", "2"],
    ):
        done = cli_here(*argv, "--cluster", path)
        assert (
            done.returncode == 2 and words in done.stderr and "must be a number > 0" in done.stderr
        )


def test_a_cluster_without_the_sim_backend_is_refused(cli_here):
    done = cli_here("train", "--cluster", "dgx-h100")
    assert done.returncode == 2 and "use --backend sim" in done.stderr
    done = cli_here("bench", "--cluster", "dgx-h100")
    assert done.returncode == 2 and "add --backends sim" in done.stderr
