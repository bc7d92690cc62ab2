"""The Collectives page under ``AppTest``: controls by key, the buttons, the caption, metrics,
figure."""

from __future__ import annotations

import json
import time

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra is not installed: pip install "
                                             "'dplab[viz]'")
pytest.importorskip("plotly", reason="the viz extra is not installed: pip install 'dplab[viz]'")
from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.reference.algorithms import allreduce_schedule  # noqa: E402
from dplab.viz.collectives_figure import arrows  # noqa: E402
from dplab.viz.serve import app_path  # noqa: E402


def _page(**params: str) -> AppTest:
    at = AppTest.from_file(str(app_path()), default_timeout=30)
    for name, value in params.items():
        at.query_params[name] = value
    at.run()
    at.switch_page("pages/collectives.py").run()
    assert not at.exception, at.exception
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _spec(at: AppTest, i: int = 0) -> dict:
    return json.loads(at.get("plotly_chart")[i].proto.spec)


def test_next_moves_the_caption_metrics_and_figure():
    at = _page()
    # plain words and triangles Chromium's fonts have (⏮/⏭ drew as boxes)
    assert [b.label for b in at.button] == ["First", "◀ Prev", "Next ▶", "Last"]
    assert at.caption[0].value.startswith("round 1 of 6, reduce-scatter: rank 0 sends chunk 3 to "
                                          "rank 1")
    assert _metrics(at) == {"rounds done": "0 of 6", "bytes sent, busiest rank": "0 B",
                            "cost-model time so far": "0.00 µs"}
    for _ in range(3):
        at.button(key="coll_next").click().run()
    assert at.caption[0].value.startswith("round 4 of 6, all-gather: rank 0 sends chunk 0 to rank "
                                          "1, which copies it")
    # ring, p=4, n=8 float32: 8 bytes a chunk, one message per round:
    # 3 rounds = 24 B and 3 x (5 µs + 8 B at 10 GB/s) + the adds (8 B at 20 GB/s): 15.0072 µs
    assert _metrics(at) == {"rounds done": "3 of 6", "bytes sent, busiest rank": "24 B",
                            "cost-model time so far": "15.00 µs"}
    spec = _spec(at)
    assert len(spec["frames"]) == 7 and spec["layout"]["sliders"][0]["active"] == 3
    assert arrows(spec["layout"]) == list(allreduce_schedule("ring", 4).rounds[3])
    assert spec["layout"]["updatemenus"][0]["buttons"][0]["label"] == "▶ Play"
    assert at.query_params["coll_round"] == "3"
    at.button(key="coll_last").click().run()
    assert at.caption[0].value.startswith("done after 6 rounds")
    assert _metrics(at)["bytes sent, busiest rank"] == "48 B"
    at.button(key="coll_next").click().run()  # past the end: stays there
    assert _metrics(at)["rounds done"] == "6 of 6"
    at.button(key="coll_prev").click().run()
    at.button(key="coll_first").click().run()
    assert _metrics(at)["rounds done"] == "0 of 6"


def test_controls_by_key_change_the_schedule():
    at = _page()
    at.selectbox(key="coll_algorithm").set_value("tree").run()
    at.slider(key="coll_p").set_value(6).run()
    at.button(key="coll_next").click().run()
    assert at.caption[0].value == ("round 2 of 6, reduce up the tree: rank 2 sends its whole "
                                   "buffer to rank 0, which adds it")
    spec = _spec(at)
    assert len(spec["frames"]) == 7 and len(spec["data"][0]["z"]) == 6  # 6 ranks x 1 chunk
    # tree has none: ring it is
    at.selectbox(key="coll_collective").set_value("reduce_scatter").run()
    assert not at.exception
    assert at.selectbox(key="coll_algorithm").value == "ring"
    assert at.caption[0].value.startswith("round 2 of 5, reduce-scatter:")


def test_side_by_side_runs_both_on_the_same_round():
    at = _page()
    at.selectbox(key="coll_vs").set_value("tree").run()
    at.button(key="coll_next").click().run()
    captions = [c.value for c in at.caption]
    assert captions[0].startswith("round 2 of 6, reduce-scatter")
    assert captions[1].startswith("round 2 of 4, reduce up the tree")
    assert len(at.get("plotly_chart")) == 2 and len(_spec(at, 1)["frames"]) == 5
    assert [m.value for m in at.metric if m.label == "rounds done"] == ["1 of 6", "1 of 4"]


def test_a_deep_link_opens_the_same_picture():
    at = _page(coll_collective="broadcast", coll_algorithm="tree", coll_p="8", coll_root="3",
               coll_round="2")
    assert at.caption[0].value == ("round 3 of 3, broadcast down the tree: rank 3 sends its whole "
                                   "buffer to rank 4, which copies it; rank 5 sends its whole "
                                   "buffer to rank 6, which copies it; rank 7 sends its whole "
                                   "buffer to rank 0, which copies it; rank 1 sends its whole "
                                   "buffer to rank 2, which copies it")
    assert _metrics(at)["rounds done"] == "2 of 3"


def test_first_render_is_fast_at_p16():
    at = AppTest.from_file(str(app_path()), default_timeout=30)
    at.query_params["coll_p"] = "16"
    at.run()
    # CPU seconds of this process (the script runs in a thread of it), not wall time: the render's
    # own work, not the time other jobs on the machine take from it (7 s of wall at load 9)
    start = time.process_time()
    at.switch_page("pages/collectives.py").run()
    used = time.process_time() - start
    assert not at.exception and len(_spec(at)["frames"]) == 31
    assert used < 3.0, f"first render of the p=16 ring took {used:.2f} CPU-s"
