"""The Training page under streamlit's AppTest: a small real grid from a deep link, its figures'
specs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from streamlit.testing.v1 import AppTest  # noqa: E402

VIZ = Path(__file__).resolve().parents[1] / "viz"
PAGE = str(VIZ / "pages" / "training.py")
SMALL = {"world_size": "3", "steps": "3", "hidden": "32", "staleness": "0,inf", "factor": "2.0"}


@pytest.fixture(scope="module", autouse=True)
def _one_cache_for_this_module() -> Iterator[None]:
    """This module's tests share st.cache_data, emptied when the module starts and ends: the SMALL
    grid (8 real runs on forked ranks) is then trained once, not by each of three tests. The first
    test that asks for it trains it; a control changed afterwards asks for other cells, which
    run."""
    st.cache_data.clear()
    yield
    st.cache_data.clear()


@pytest.fixture(autouse=True)
def _fresh_streamlit_cache() -> Iterator[None]:
    """Overrides conftest's per-test clearing of st.cache_data for this module (see above)."""
    yield


def page(**query: str) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=90)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def charts(at: AppTest) -> dict[str, dict]:
    """Every plotly chart's spec, by its title."""
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return {f["layout"]["title"]["text"]: f for f in specs}


def test_a_small_grid_from_a_deep_link() -> None:
    at = page(**SMALL)
    assert not at.exception and not at.error
    assert at.caption[0].value.startswith("8 real runs of dplab compare's grid")
    assert (
        "1 server + 2 workers" in at.caption[0].value and "rank 2 2x slower" in at.caption[0].value
    )
    assert [m.label for m in at.metric] == ["ring", "backup b=1", "s=0", "s=inf"]
    assert [m.proto.help for m in at.metric][
        1
    ] == "ps backup b=1: samples/s with the straggler over samples/s without"
    assert at.caption[1].value.startswith("Throughput with rank 2 2x slower, over throughput "
                                          "without")
    assert all(re.fullmatch(r"\d+\.\d\dx", m.value) for m in at.metric)
    figs = charts(at)
    assert set(figs) >= {"loss against steps", "loss against wall time",
                         "throughput (samples applied per second)", "sync: max_abs_diff_vs_single "
                                                                    "per step"}
    assert len(figs["loss against steps"]["data"]) == 8
    steps = [d for d in figs["loss against steps"]["data"] if d["name"] == "ring"][0]
    assert steps["x"] == [0.0, 1.0, 2.0, 3.0]
    table = at.dataframe[0].value
    final = dict(zip(zip(table["run"], table["straggler"]), table["final_loss"]))
    ring_loss = [d for d in figs["loss against wall time"]["data"] if d["name"] == "ring"][0]["y"][
        -1
    ]
    # a straggler changes no bits
    assert final[("ring", "none")] == ring_loss == final[("ring", "2:2")]
    eq = figs["sync: max_abs_diff_vs_single per step"]["data"][0]["y"]
    assert len(eq) == 3 and max(eq) < 1e-12
    eq_fig = figs["sync: max_abs_diff_vs_single per step"]
    assert (
        eq_fig["layout"]["yaxis"]["type"] == "log" and eq_fig["layout"]["shapes"][0]["y0"] == 1e-10
    )
    assert eq_fig["layout"]["yaxis"]["range"][1] == -9  # the axis reaches past the tolerance
    assert (
        figs["loss against steps"]["layout"]["xaxis"]["title"]["text"]
        == "steps (global batches applied)"
    )
    assert any("a step is one global batch of gradients applied" in c.value for c in at.caption)
    delays = next(f for t, f in figs.items() if t.startswith("delay histogram"))
    ps_updates = sum(u for r, u in zip(table["run"], table["updates"]) if r != "ring")
    # W=2, b=1: one gradient per update
    assert sum(sum(d["y"]) for d in delays["data"]) == ps_updates
    assert at.query_params["staleness"] == "0,inf"


def test_controls_by_key_rerun_the_grid() -> None:
    at = page(**SMALL)
    at.multiselect(key="training_staleness").set_value(["inf"])
    at.multiselect(key="training_backup").set_value([])
    at.run()
    assert not at.exception and not at.error
    assert [m.label for m in at.metric] == ["ring", "s=inf"]
    assert at.caption[0].value.startswith("4 real runs")
    assert at.query_params["staleness"] == "inf" and at.query_params["backup"] == ""


def test_bad_deep_links_fall_back_to_defaults() -> None:
    at = page(world_size="2", steps="3", hidden="7", factor="3", staleness="inf,9", backup="5")
    assert not at.exception and not at.error
    assert at.number_input(key="training_world_size").value == 4  # 2 is below the page's minimum
    assert at.selectbox(key="training_hidden").value == 128
    assert at.selectbox(key="training_factor").value == 8.0
    assert at.multiselect(key="training_staleness").value == ["inf"]
    assert at.multiselect(key="training_backup").value == []


def test_the_app_switches_to_the_page() -> None:
    at = AppTest.from_file(str(VIZ / "app.py"), default_timeout=90)
    for k, v in SMALL.items():
        at.query_params[k] = v
    at.run()
    at.switch_page("pages/training.py").run()
    assert not at.exception and not at.error
    assert at.title[0].value == "Training: sync, backup workers, bounded staleness"
    assert at.caption[0].value.startswith("8 real runs")
