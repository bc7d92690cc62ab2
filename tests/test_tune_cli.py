"""dplab tune: bench (or read bench rows), fit, save where auto reads it;
dplab bench shows auto's pick."""

from __future__ import annotations

import json

import pytest

from dplab.backends.cli.commands import main
from dplab.reference import auto
from dplab.reference.costfit import CostFit

SIZES = (4096, 65536, 1 << 20, 16 << 20)


def synthetic_rows():
    truth = {"local": (20e-6, 1 / 8e9), "native": (5e-6, 1 / 10e9)}
    rows = []
    for p in (2, 4):
        for alg in ("ring", "tree", "naive", "native"):
            alpha, beta = truth["native" if alg == "native" else "local"]
            for n in SIZES:
                t = CostFit("local", p, alg, alpha, beta, None).predict_s(alg, p, n)
                rows.append({"backend": "local", "algorithm": alg, "world_size": p, "bytes": n,
                             "time_us": t * 1e6})
        rows += [
            {"backend": "local", "algorithm": "memcpy", "world_size": p, "bytes": n, "time_us": 1.0}
            for n in SIZES
        ]
    return rows


@pytest.fixture(autouse=True)
def _forget():
    auto.reset()
    yield
    auto.reset()


def test_tune_fits_saved_rows_and_saves_every_level_where_auto_reads_it(
    tmp_path, capsys, monkeypatch
):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"meta": {"command": "bench"}, "rows": synthetic_rows()}))
    out, table = tmp_path / "tune.json", tmp_path / "rows.json"
    assert main(["tune", "--from-json", str(bench), "--out", str(out), "--json", str(table)]) == 0
    printed = capsys.readouterr().out
    assert f"fit saved to {out}; auto reads it with DPLAB_TUNE={out}" in printed
    assert "local: rms residual of our schedules" in printed and "alpha_us" in printed
    rows = json.loads(table.read_text())["rows"]
    head = {(r["world_size"], r["algorithm"]): r for r in rows}
    assert head[("all", "all")]["alpha_us"] == pytest.approx(20) and head[("all", "all")][
        "beta_gbps"
    ] == (pytest.approx(8))
    assert head[("all", "native")]["alpha_us"] == pytest.approx(5)
    assert head[(4, "tree")]["max_residual_pct"] < 1e-6 and len(rows) == 1 + 1 + 2 * 2 + 2 * 3
    saved = auto.load_tuning(out)
    assert len(saved.fits) == len(rows) and saved.fit_for(
        "local", "native", 4
    ).alpha == pytest.approx(5e-6)
    monkeypatch.setenv(auto.TUNE_ENV, str(out))
    auto.reset()
    assert auto.current().source == str(out)
    assert auto.choose("local", 4, 16 << 20) == "native"  # 10 GB/s against our 8


def test_tune_refuses_what_it_cannot_fit_in_one_line(tmp_path, capsys):
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps({"meta": {"command": "train"}, "rows": []}))
    assert main(["tune", "--from-json", str(bad), "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dplab tune: error: {bad} holds `dplab train` rows: give `dplab bench --json` "
                   "output"]
    assert (
        main(
            ["tune", "--from-json", str(tmp_path / "none.json"), "--out", str(tmp_path / "t.json")]
        )
        == 2
    )
    assert "No such file" in capsys.readouterr().err
    assert main(["tune", "--algorithms", "nosuch", "--out", str(tmp_path / "t.json")]) == 2
    assert "unknown algorithm 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_a_short_real_tune_then_bench_shows_what_auto_ran(tmp_path, monkeypatch, capsys):
    out = tmp_path / "tune.json"
    assert (
        main(
            [
                "tune",
                "--world-sizes",
                "2",
                "--sizes",
                "4K,64K",
                "--algorithms",
                "ring,tree,native",
                "--reps",
                "1",
                "--target-seconds",
                "0.01",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    saved = auto.load_tuning(out)
    assert {(f.world_size, f.algorithm) for f in saved.fits} == {
        ("all", "all"), ("all", "native"), (2, "all"), (2, "native"), (2, "ring"), (2, "tree")}
    monkeypatch.setenv(auto.TUNE_ENV, str(out))
    auto.reset()
    capsys.readouterr()
    rows_path = tmp_path / "bench.json"
    assert main(["bench", "--world-sizes", "2", "--sizes", "4K,64K", "--algorithms", "auto,ring",
                 "--reps", "1", "--target-seconds", "0.01", "--json", str(rows_path)]) == 0
    assert " ran " in capsys.readouterr().out.splitlines()[0] + " "
    rows = [r for r in json.loads(rows_path.read_text())["rows"] if r["algorithm"] == "auto"]
    assert [r["ran"] for r in rows] == [saved.choose("local", 2, n) for n in (4096, 65536)]


def test_a_missing_tune_file_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(auto.TUNE_ENV, str(tmp_path / "none.json"))
    assert main(["bench", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dplab bench: error: no tune file at {tmp_path / 'none.json'}: run "
                   f"`dplab tune --out {tmp_path / 'none.json'}` first"]
