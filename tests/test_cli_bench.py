"""``dplab bench``: each run's ratios against its own memcpy row and the engine's own all-reduce."""

from __future__ import annotations

import json
import re

import pytest

from dplab.backends.bench.timing import summarize
from dplab.backends.cli.args import build_parser
from dplab.backends.cli.commands import main


def _timings(alg: str, nbytes: int, seconds: float) -> dict:
    import numpy as np

    return {"algorithm": alg, "bytes": nbytes, "times": np.full(3, seconds), "staged_bytes": 0}


def test_ratios_are_against_the_same_runs_memcpy_and_native():
    per_rank = [
        {
            "allreduce": [_timings("ring", 1000, 2e-6), _timings("native", 1000, 1e-6)],
            "memcpy": [_timings("memcpy", 1000, 0.5e-6)],
        }
        if r == 0
        else {
            "allreduce": [_timings("ring", 1000, 2e-6), _timings("native", 1000, 1e-6)],
            "memcpy": [],
        }
        for r in range(2)
    ]
    rows = {r["algorithm"]: r for r in summarize("mpi", 2, per_rank)}
    assert rows["memcpy"]["backend"] == "mpi" and rows["memcpy"]["world_size"] == 2
    assert rows["memcpy"]["busbw_gbps"] == pytest.approx(1000 / 0.5e-6 / 1e9)
    assert rows["ring"]["busbw_gbps"] == pytest.approx(0.5)  # algbw 0.5 GB/s x 2(2-1)/2
    assert rows["ring"]["vs_memcpy"] == pytest.approx(0.5 / 2.0)
    assert rows["ring"]["vs_native"] == pytest.approx(0.5)  # twice native's time
    assert rows["native"]["vs_native"] == 1.0
    assert rows["memcpy"]["vs_native"] is None


def test_several_worlds_pool_their_reps_into_each_cells_median(tmp_path):
    import numpy as np

    from dplab.backends.bench.spec import pooled

    def world(seconds: float, staged: int) -> list[dict]:  # 2 ranks, rank 0 with the memcpy row
        cell = _timings("ring", 1000, seconds) | {"staged_bytes": staged}
        return [{"allreduce": [cell], "memcpy": [_timings("memcpy", 1000, 1e-6)][:1 - r]}
                for r in range(2)]

    one = pooled([world(1e-6, 0), world(1e-6, 8), world(5e-6, 0)])
    assert [len(rank["memcpy"]) for rank in one] == [1, 0]
    assert np.array_equal(one[1]["allreduce"][0]["times"], [1e-6] * 6 + [5e-6] * 3)
    assert one[0]["allreduce"][0]["staged_bytes"] == 8
    rows = {r["algorithm"]: r for r in summarize("local", 2, one)}
    assert rows["ring"]["time_us"] == pytest.approx(1.0)  # the median of 9 reps, not of 3 worlds
    out = tmp_path / "bench.json"
    assert main(["bench", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring",
                 "--target-seconds", "0.01", "--reps", "2", "--worlds", "2",
                 "--json", str(out)]) == 0
    assert [r["algorithm"] for r in json.loads(out.read_text())["rows"]] == ["ring", "memcpy"]


def test_bench_prints_each_runs_memcpy_row_and_vs_native(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--world-sizes", "2,3", "--sizes", "4K", "--algorithms", "ring,native",
                 "--target-seconds", "0.01", "--reps", "3", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert "vs_native" in header and "vs_memcpy" in header
    rows = json.loads(out.read_text())["rows"]
    memcpy = {r["world_size"]: r for r in rows if r["algorithm"] == "memcpy"}
    assert set(memcpy) == {2, 3}  # one per run, each printed
    printed = [line.split() for line in table.splitlines()[2:] if " memcpy " in line]
    assert [int(cells[2]) for cells in printed] == [2, 3]
    for r in rows:
        if r["algorithm"] == "memcpy":
            continue
        native = next(
            n for n in rows if n["algorithm"] == "native" and n["world_size"] == r["world_size"]
        )
        assert r["vs_native"] == pytest.approx(r["busbw_gbps"] / native["busbw_gbps"], rel=1e-12)
        assert r["vs_memcpy"] == pytest.approx(
            r["busbw_gbps"] / memcpy[r["world_size"]]["busbw_gbps"], rel=1e-12
        )


def test_help_defines_algbw_busbw_and_vs_native_in_a_sentence_each():
    sub = next(a for a in build_parser()._actions if hasattr(a, "_name_parser_map")).choices[
        "bench"
    ]
    text = re.sub(r"\s+", " ", sub.format_help())
    assert "algbw_gbps algorithm bandwidth: bytes / time" in text
    assert (
        "busbw_gbps bus bandwidth: algbw x 2(p-1)/p for all-reduce (nccl-tests' convention)" in text
    )
    assert "vs_native this algorithm's busbw / the busbw of the engine's own all-reduce" in text
    assert "same backend, world size and bytes, in the same run" in text


def test_busbw_is_zero_at_one_rank_as_in_nccl_tests():
    """Nothing travels at p = 1: busbw 0 (nccl-tests' 2 (p-1)/p), and no ratio divides by it."""
    per_rank = [{"allreduce": [_timings("ring", 1000, 1e-6), _timings("native", 1000, 1e-6)],
                 "memcpy": [_timings("memcpy", 1000, 0.5e-6)]}]
    rows = {r["algorithm"]: r for r in summarize("torch", 1, per_rank)}
    assert rows["ring"]["busbw_gbps"] == 0 and rows["ring"]["algbw_gbps"] == pytest.approx(1.0)
    assert rows["ring"]["vs_native"] is None and rows["ring"]["vs_memcpy"] == 0
    assert rows["memcpy"]["busbw_gbps"] == pytest.approx(2.0)  # a copy's bytes / time, at any p


def test_every_clock_read_waits_for_the_device(monkeypatch):
    """On a GPU the kernels run asynchronously: a timed loop synchronizes before both clock reads,
    so it times the device's work, not the launches (checked here with a recording stand-in)."""
    from dplab.backends.bench import timing as bench

    torch = pytest.importorskip("torch")
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: events.append("clock") or 0.0)

    class Comm:
        device = torch.device("cuda", 0)

    dev = bench.Device(Comm())
    assert dev.cuda
    bench._time_loop(lambda: events.append("call"), 2, dev.sync)
    assert events == ["sync", "clock", "call", "call", "sync", "clock"]
    assert not bench.Device(object()).cuda  # a host communicator: numpy buffers, no waiting


def test_a_cuda_bench_without_a_gpu_is_one_line(capsys, monkeypatch):
    pytest.importorskip("torch")
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("DPLAB_DEVICE", raising=False)
    assert main(["bench", "--backends", "torch", "--device", "cuda", "--world-sizes", "1",
                 "--sizes", "1M"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GPU" in err and "--device cpu" in err
    # --device is the command's: called in-process, it must not set the device of every later one
    # (it did, and every torch test after this one asked for GPUs)
    assert "DPLAB_DEVICE" not in os.environ
