"""The Training page on a simulated cluster (AppTest): the same grid on the sim backend, every time
labelled as that cluster's simulated time; and a sim trace opens in Perfetto's format, labelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.backends.cli.commands import main  # noqa: E402

PAGE = str(Path(__file__).resolve().parents[1] / "viz" / "pages" / "training.py")
SMALL = {"world_size": "3", "steps": "3", "hidden": "32", "staleness": "0", "factor": "2.0",
         "cluster": "dgx-h100"}


def test_the_training_page_runs_its_grid_on_a_simulated_cluster():
    at = AppTest.from_file(PAGE, default_timeout=120)
    for k, v in SMALL.items():
        at.query_params[k] = v
    at = at.run()
    assert not at.exception and not at.error
    assert at.selectbox[0].value == "dgx-h100"
    assert "on the sim backend, in simulated time on dgx-h100: 1 x 8 ranks" in at.caption[0].value
    assert any(c.value.startswith("Simulated, not measured") for c in at.caption)
    figs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
            for c in at.get("plotly_chart")}
    assert "loss against simulated time" in figs
    xaxis = figs["loss against simulated time"]["layout"]["xaxis"]["title"]["text"]
    assert xaxis == "simulated time on dgx-h100 (s)"
    ring = [d for d in figs["loss against simulated time"]["data"] if d["name"] == "ring"][0]
    assert 0 < ring["x"][-1] < 0.01  # 3 steps of a small MLP on H100s: ms, not the host's seconds


def test_a_sim_trace_is_labelled_for_perfetto(tmp_path):
    trace = tmp_path / "run.json"
    argv = ["train", "--backend", "sim", "--cluster", "dgx-h100", "--world-size", "2",
            "--steps", "2", "--trace", str(trace)]
    assert main(argv) == 0
    chrome = json.loads(trace.with_suffix(".chrome.json").read_text())
    names = [e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 0 (simulated: dgx-h100)", "rank 1 (simulated: dgx-h100)"]
    assert chrome["otherData"]["clock"] == "simulated time on dgx-h100"
