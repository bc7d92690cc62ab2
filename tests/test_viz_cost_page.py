"""The Cost page under streamlit's AppTest: controls, the crossover sentence, the figure, a bench
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.reference.costmodel import cost  # noqa: E402
from dplab.viz import cost as viz_cost  # noqa: E402
from dplab.viz.cost import CostParams, features, model_time  # noqa: E402
from dplab.viz.cost_crossovers import crossovers  # noqa: E402

PAGE = str(Path(__file__).resolve().parents[1] / "viz" / "pages" / "cost.py")



def page(**query: str) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def captions(at: AppTest) -> list[str]:
    return [c.value for c in at.caption]


def figure(at: AppTest, key: str = "cost_figure") -> dict:
    chart = next(
        c for c in at.get("plotly_chart") if json.loads(c.proto.spec) and key in c.proto.id
    )
    return json.loads(chart.proto.spec)


def test_first_render_names_the_crossovers_and_draws_the_model(monkeypatch):
    # Quick to first paint, counted rather than timed: the render prices each (algorithm, grid
    # size) once, and its bisections; not each pair's sizes again, for the captions and again for
    # the figure, which took seconds of CPU.
    priced = []

    def counted(*args, **kwargs):  # noqa: ANN202 - costmodel.cost, counted
        priced.append(args[:2])
        return cost(*args, **kwargs)

    monkeypatch.setattr(viz_cost, "cost", counted)
    model_time.cache_clear()
    features.cache_clear()
    at = page()
    assert not at.exception and not at.error
    # ring and direct cross tree at one size: one sentence, one marker, one caption for the tie;
    # and the size where MPICH switches from recursive doubling to Rabenseifner (every registered
    # algorithm is drawn)
    crossings = [c for c in captions(at) if c.startswith("Crossover")]
    assert crossings[:2] == ["Crossover 1: tree beats ring and direct below 91.9 KiB at p=8.",
                             "Crossover 2: recursive_doubling beats rabenseifner below 117 KiB at "
                             "p=8."]
    assert ("ring and direct cost the same at every size at p=8 (within one element per message), "
            "so their curves coincide: direct is drawn dashed over ring.") in captions(at)
    fig = figure(at)
    names = [d["name"] for d in fig["data"]]
    assert names[:4] == ["naive (model)", "ring (model)", "tree (model)", "direct = ring (model)"]
    assert names[-1] == "crossovers" and {
        "recursive_doubling (model)",
        "rabenseifner (model)",
    } <= set(names)
    assert fig["data"][3]["line"]["dash"] == "dash" and fig["data"][1]["line"]["dash"] == "solid"
    # as the captions
    assert fig["data"][-1]["text"] == [f"<b>{i}</b>" for i in range(1, len(crossings) + 1)]
    assert fig["layout"]["legend"]["y"] > 1  # above the plot, off the x axis' title
    ring = fig["data"][1]
    params = CostParams()
    assert ring["y"][20] == pytest.approx(model_time("ring", ring["x"][20], params) * 1e6)
    assert fig["layout"]["xaxis"]["type"] == "log"
    grid = sum(len(d["x"]) for d in fig["data"] if d["name"].endswith("(model)"))
    assert grid <= len(priced) <= 2 * grid, (len(priced), grid)


def test_controls_move_the_crossover_and_the_url():
    at = page()
    at.slider(key="cost_world_size").set_value(16)
    at.select_slider(key="cost_alpha_us").set_value(20.0)
    at.select_slider(key="cost_beta_gbps").set_value(25.0)
    at.select_slider(key="cost_gamma").set_value("10")
    at.radio(key="cost_y").set_value("busbw")
    at.multiselect(key="cost_algorithms").set_value(["ring", "tree"]).run()
    assert not at.exception and not at.error
    want = crossovers(CostParams(alpha_s=20e-6, beta_gbps=25, gamma_gbps=10, world_size=16,
                                 algorithms=("ring", "tree")))
    assert len(want) == 1
    assert f"Crossover 1: {want[0].sentence()}." in captions(at)
    assert want[0].sentence().startswith("tree beats ring below ") and want[0].sentence().endswith(
        " at p=16"
    )
    assert any(
        c.startswith("busbw = algbw × 2(p-1)/p = algbw × 1.88 at p=16") for c in captions(at)
    )
    fig = figure(at)
    assert [d["name"] for d in fig["data"]] == ["ring (model)", "tree (model)", "crossovers"]
    assert fig["layout"]["yaxis"]["title"]["text"] == "busbw (GB/s)"
    assert at.query_params["world_size"] == "16" and at.query_params["y"] == "busbw"
    assert (
        at.query_params["algorithms"] == "ring,tree"
        and at.query_params["sizes"] == "1024,268435456"
    )


def test_a_deep_link_sets_the_controls_and_a_bad_value_falls_back():
    at = page(world_size="3", alpha_us="7", sizes="1024,65536", algorithms="ring,tree")
    assert not at.exception
    assert at.slider(key="cost_world_size").value == 3
    assert at.select_slider(key="cost_alpha_us").value == 5.0  # 7 is not an option: the default
    assert "No crossover between ring, tree from 1 KiB to 64 KiB at p=3." in captions(at)
    assert not any("coincide" in c for c in captions(at))  # ring and tree do not tie
    fig = figure(at)
    assert fig["data"][0]["x"][0] == 1024 and fig["data"][0]["x"][-1] == 65536


def synthetic_rows() -> list[dict]:
    rows = []
    for p in (2, 8):
        for alg in ("ring", "tree"):
            for n in (4096, 1 << 16, 1 << 20):
                a, b = features(alg, p, n)
                rows.append(
                    {
                        "backend": "local",
                        "algorithm": alg,
                        "world_size": p,
                        "bytes": n,
                        "time_us": (12e-6 * a + b / 7e9) * 1e6,
                        "algbw_gbps": 0,
                        "busbw_gbps": 0,
                    }
                )
    rows.append(
        {"backend": "local", "algorithm": "memcpy", "world_size": 8, "bytes": 4096, "time_us": 0.5}
    )
    return rows


def test_a_bench_json_file_is_fitted_and_overlaid(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"command": "bench"}, "rows": synthetic_rows()}))
    at = page()
    at.radio(key="cost_source").set_value("file").run()
    at.file_uploader(key="cost_files").set_value(
        ("bench.json", path.read_bytes(), "application/json")
    ).run()
    assert not at.exception and not at.error
    fit = [c for c in captions(at) if c.startswith("fit local")]
    assert len(fit) == 1 and fit[0].startswith("fit local (all, 12 rows): α = 12 µs, β = 7 GB/s, "
                                               "residuals")
    (table,) = [d.value for d in at.dataframe]
    assert table["alpha_us"].iloc[0] == pytest.approx(12) and table["beta_gbps"].iloc[
        0
    ] == pytest.approx(7)
    fig = figure(at)
    names = [d["name"] for d in fig["data"]]
    assert "ring (local, measured)" in names and "tree (local, fitted)" in names
    measured = next(d for d in fig["data"] if d["name"] == "ring (local, measured)")
    assert measured["x"] == [4096, 1 << 16, 1 << 20]  # the p=8 rows only: the page's world size
    residuals = figure(at, "cost_residuals")
    assert all(abs(y) < 1e-6 for d in residuals["data"] if "y" in d for y in d["y"])
    at.radio(key="cost_fit_by").set_value("algorithm").run()
    assert len([c for c in captions(at) if c.startswith("fit local")]) == 2


def test_a_file_that_is_not_bench_output_is_refused_in_one_line():
    at = page()
    at.radio(key="cost_source").set_value("file").run()
    at.file_uploader(key="cost_files").set_value(
        ("x.json", b'{"meta": {"command": "train"}, "rows": []}', "application/json")
    ).run()
    assert not at.exception
    assert [e.value for e in at.error] == [
        "x.json holds `dplab train` rows: give `dplab bench --json` output"]


def test_a_short_bench_runs_now_and_is_fitted():
    at = page(world_size="2", source="run", bench_sizes="4096,65536")
    assert list(at.multiselect(key="cost_bench_sizes").value) == [4096, 65536]
    assert not at.exception and not at.error
    fit = [c for c in captions(at) if c.startswith("fit local (all, 6 rows)")]
    assert len(fit) == 1  # ring, tree, naive at two sizes; native and memcpy are not fitted
    names = [d["name"] for d in figure(at)["data"]]
    assert {"ring (local, measured)", "native (local, measured)", "ring (local, fitted)"} <= set(
        names
    )


def test_the_app_lists_the_cost_page_and_reaches_it():
    app = Path(PAGE).parents[1] / "app.py"
    at = AppTest.from_file(str(app), default_timeout=60).run()
    assert "Cost" in [link.proto.label for link in at.get("page_link")]
    at.switch_page("pages/cost.py").run()
    assert not at.exception
    assert at.title[0].value == "Cost: α, β, γ against message size"
    assert "Crossover 1: tree beats ring and direct below 91.9 KiB at p=8." in captions(at)
