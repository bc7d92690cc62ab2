"""The cost page's measured side: the alpha/beta fit, its residuals, bench JSON, a real short
bench."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.viz.cost import features  # noqa: E402
from dplab.viz.cost_fit import (  # noqa: E402
    fit_alpha_beta,
    fit_table,
    load_bench_json,
    residual_figure,
    residual_rows,
    run_bench,
)

SIZES = (4096, 65536, 1 << 20, 16 << 20)


def synthetic(backend, alg, p, alpha, beta, sizes=SIZES):
    return [{"backend": backend, "algorithm": alg, "world_size": p, "bytes": n,
             "time_us": 1e6 * sum(c * f for c, f in zip((alpha, beta), features(alg, p, n)))}
            for n in sizes]


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_known_alpha_and_beta_exactly(relative):
    rows = (
        synthetic("local", "ring", 4, 12e-6, 1 / 7e9)
        + synthetic("local", "tree", 4, 12e-6, 1 / 7e9)
        + synthetic("local", "naive", 2, 12e-6, 1 / 7e9)
        + synthetic("mpi", "ring", 2, 3e-6, 1 / 20e9)
        + synthetic("mpi", "ring", 4, 3e-6, 1 / 20e9)
    )
    rows.append(
        {"backend": "local", "algorithm": "native", "world_size": 4, "bytes": 4096, "time_us": 1.0}
    )
    rows.append(
        {"backend": "local", "algorithm": "memcpy", "world_size": 4, "bytes": 4096, "time_us": 1.0}
    )
    fits = fit_alpha_beta(rows, relative=relative)
    assert [(f.backend, f.algorithm, len(f.rows)) for f in fits] == [
        ("local", "all", 12),
        ("mpi", "all", 8),
    ]
    assert fits[0].alpha_s == pytest.approx(12e-6, rel=1e-9)
    assert fits[0].beta_gbps == pytest.approx(7, rel=1e-9)
    assert fits[1].alpha_s == pytest.approx(3e-6, rel=1e-9)
    assert fits[1].beta_gbps == pytest.approx(20, rel=1e-9)
    for f in fits:
        assert all(abs(r["residual_pct"]) < 1e-7 for r in residual_rows(f))
    table = fit_table(fits)
    assert table[0]["alpha_us"] == pytest.approx(12) and table[0]["max_residual_pct"] < 1e-7


def test_fit_per_algorithm_separates_them_and_residuals_are_measured_minus_fitted():
    rows = synthetic("local", "ring", 4, 10e-6, 1e-10) + synthetic("local", "tree", 4, 40e-6, 2e-10)
    rows[0] = dict(rows[0], time_us=rows[0]["time_us"] * 1.5)  # one noisy row
    fits = {f.algorithm: f for f in fit_alpha_beta(rows, per_algorithm=True)}
    assert fits["tree"].alpha_s == pytest.approx(40e-6) and fits["tree"].beta == pytest.approx(
        2e-10
    )
    ring = residual_rows(fits["ring"])
    for r in ring:
        assert r["residual_us"] == pytest.approx(r["measured_us"] - r["fitted_us"])
        assert r["residual_pct"] == pytest.approx(100 * r["residual_us"] / r["measured_us"])
    assert abs(ring[0]["residual_pct"]) > 1
    fig = residual_figure(list(fits.values()))
    assert [t.name for t in fig.data] == ["local ring", "local tree"]
    assert list(fig.data[0].y) == pytest.approx([r["residual_pct"] for r in ring])


def test_one_size_cannot_fit_two_unknowns():
    (f,) = fit_alpha_beta(synthetic("local", "ring", 4, 1e-5, 1e-10, sizes=(4096,)))
    assert f.alpha_s is None and "two sizes" in f.note
    assert fit_table([f])[0]["alpha_us"] is None


def test_bench_json_is_read_as_dplab_bench_writes_it(tmp_path):
    rows = synthetic("local", "ring", 2, 1e-5, 1e-10)
    text = json.dumps({"meta": {"command": "bench"}, "rows": rows})
    assert load_bench_json(text) == rows
    assert load_bench_json(json.dumps(rows).encode()) == rows
    with pytest.raises(ConfigError, match="not JSON"):
        load_bench_json("{", "x.json")
    with pytest.raises(ConfigError, match="dplab train"):
        load_bench_json(json.dumps({"meta": {"command": "train"}, "rows": []}))
    with pytest.raises(ConfigError, match="lacks time_us"):
        load_bench_json(
            json.dumps([{"backend": "local", "algorithm": "ring", "world_size": 2, "bytes": 4}])
        )


def test_a_short_real_bench_runs_through_the_command_line_and_fits():
    rows = run_bench(
        [2], [4096, 1 << 16], algorithms=("ring", "native"), reps=2, target_seconds=0.02
    )
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [
        ("ring", 4096), ("native", 4096), ("ring", 1 << 16), ("native", 1 << 16),
        ("memcpy", 4096), ("memcpy", 1 << 16)]
    assert all(r["time_us"] > 0 and r["world_size"] == 2 and r["backend"] == "local" for r in rows)
    (f,) = fit_alpha_beta(rows)
    assert len(f.rows) == 2 and f.alpha_s is not None  # two points, two unknowns: an exact line
    assert all(abs(r["residual_pct"]) < 1e-6 for r in residual_rows(f))
