"""The Runs page under streamlit's AppTest: make a run, load a trace file, read metrics and figure
spec."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.backends.runs.run import RunSpec, run_train  # noqa: E402
from dplab.reference.trace import merge  # noqa: E402
from dplab.reference.train.single import TrainConfig  # noqa: E402
from dplab.viz.timeline import trace_bytes  # noqa: E402
from dplab.viz.timeline_metrics import find_straggler, rank_stats, totals  # noqa: E402

VIZ = Path(__file__).resolve().parents[1] / "viz"
PAGE = str(VIZ / "pages" / "runs.py")



def page(**query: str) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def figure(at: AppTest) -> dict:
    return json.loads(at.get("plotly_chart")[0].proto.spec)


def test_make_a_run_from_a_deep_link() -> None:
    at = page(world_size="2", hidden="16", steps="3")
    assert not at.exception and not at.error
    assert set(metrics(at)) == {"wall", "communication", "comm. hidden", "exposed comm.",
                                "waiting", "straggler"}
    # every time but the wall says its scope: the mean over the ranks, the sum in its help
    scope = {m.label: m.proto.delta for m in at.metric}
    assert scope["communication"] == scope["exposed comm."] == scope["waiting"] == "mean of 2 ranks"
    assert scope["wall"] == "first to last span" and scope["comm. hidden"] == "over all ranks"
    assert "summed over them" in next(m.proto.help for m in at.metric if m.label == "waiting")
    assert metrics(at)["comm. hidden"].endswith(" %")
    run = next(c.value for c in at.caption if c.value.startswith("the run:"))
    assert (
        "mode sync, algorithm ring, world_size 2, steps 3" in run
        and "max_abs_diff_vs_single" in run
    )
    fig = figure(at)
    assert fig["layout"]["yaxis"]["categoryarray"] == [
        "rank 0 · main",
        "rank 0 · comm",
        "rank 1 · main",
        "rank 1 · comm",
    ]
    bars = {d["name"]: Counter(d["y"]) for d in fig["data"]}
    assert all(d["type"] == "bar" and d["orientation"] == "h" and "base" in d for d in fig["data"])
    assert bars["forward"] == {"rank 0 · main": 3, "rank 1 · main": 3}
    assert bars["bucket"] == {"rank 0 · comm": 9, "rank 1 · comm": 9}  # 3 buckets a step
    assert {"backward", "wait", "optimizer"} <= set(bars)
    assert [b.proto.label for b in at.get("download_button")] == [
        "Chrome trace (open in ui.perfetto.dev)", "dplab trace (load it here again)"]
    assert at.query_params["world_size"] == "2" and at.query_params["mode"] == "sync"
    table = at.dataframe[0].value
    assert list(table["rank"]) == [0, 1] and list(table["role"]) == ["replica", "replica"]

    # every send and receive: more bars, same run
    at.toggle(key="runs_detail").set_value(True).run()
    assert {"send", "reduce", "copy"} <= {d["name"] for d in figure(at)["data"]}


def test_controls_by_key_name_the_straggler() -> None:
    """Rank 1 eight times slower: its median step measured 7.5x-14.5x its peer's in 8 runs here,
    on busy cores (named from 2x)."""
    at = page(world_size="2", hidden="16", steps="3")
    at.number_input(key="runs_steps").set_value(5)
    at.selectbox(key="runs_straggler").set_value("1")
    at.select_slider(key="runs_factor").set_value(8.0)
    at.run()
    assert not at.exception and not at.error
    assert metrics(at)["straggler"] == "rank 1"
    assert next(m.proto.delta for m in at.metric if m.label == "straggler") == "configured"
    assert any(c.value.startswith("rank 1 is the straggler: ") for c in at.caption)
    assert "slowdown" in {d["name"] for d in figure(at)["data"]}
    assert at.query_params["straggler"] == "1" and at.query_params["factor"] == "8.0"
    assert at.query_params["steps"] == "5"


def test_async_run_and_a_refused_config() -> None:
    at = page(world_size="3", hidden="16", steps="3", mode="async", staleness="inf")
    assert not at.exception and not at.error
    lanes = figure(at)["layout"]["yaxis"]["categoryarray"]
    assert lanes == ["rank 0 · main", "rank 1 · main", "rank 2 · main"]
    names = {d["name"] for d in figure(at)["data"]}
    assert {"wait", "pull", "compute", "push", "reply", "apply"} <= names
    at.number_input(key="runs_world_size").set_value(1).run()  # a server and no worker
    assert at.error and "world" in at.error[0].value.lower()
    assert not at.get("plotly_chart")


def test_load_a_trace_file_shows_its_computed_numbers() -> None:
    row, per_rank = run_train(RunSpec(world_size=2, train=TrainConfig(steps=2)), trace=True)
    events = merge(per_rank)
    at = page(source="file")
    assert any("dplab train" in i.value for i in at.info)
    at.get("file_uploader")[0].set_value(
        ("run.json", trace_bytes(events, {"row": row}), "application/json")
    )
    at.run()
    assert not at.exception and not at.error
    # the row says no straggler was configured; the file's machine and cores are not known here
    t, s = totals(rank_stats(events)), find_straggler(rank_stats(events), configured=())
    assert metrics(at) == {
        "wall": f"{t['wall_ms']:.1f} ms", "communication": f"{t['comm_ms'] / 2:.1f} ms",
        "comm. hidden": f"{t['overlap_pct']:.1f} %",
        "exposed comm.": f"{t['exposed_comm_ms'] / 2:.1f} ms",
        "waiting": f"{t['wait_ms'] / 2:.1f} ms",
        "straggler": "none" if s.rank is None else f"rank {s.rank}"}
    assert s.sentence in [c.value for c in at.caption]
    assert "world_size 2, steps 2" in next(
        c.value for c in at.caption if c.value.startswith("the run:")
    )
    assert sum(len(d["y"]) for d in figure(at)["data"] if d["name"] == "forward") == 4

    at.get("file_uploader")[0].set_value(
        ("bad.json", b'{"traceEvents": []}', "application/json")
    ).run()
    assert at.error and "not a dplab trace file" in at.error[0].value


def test_reached_through_the_app() -> None:
    """The app lists the page: switch to it from the entry, deep link and all."""
    at = AppTest.from_file(str(VIZ / "app.py"), default_timeout=60)
    at.query_params["world_size"] = "2"
    at.query_params["steps"] = "2"
    at.run()
    at.switch_page("pages/runs.py").run()
    assert not at.exception and not at.error
    assert at.title[0].value == "Runs" and metrics(at)["straggler"] in {"none", "rank 0", "rank 1"}
    assert figure(at)["layout"]["yaxis"]["categoryarray"][0] == "rank 0 · main"
