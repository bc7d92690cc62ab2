"""The validation tables' predictions are the simulator's, not typed: the cheap ones are made
again here from the shipped presets and compared with the shipped rows
(backends/perf/validation_*.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dplab.backends.sim import validate
from dplab.backends.sim.timing import bench_rows, collective_time
from dplab.reference.cluster import cluster

PERF = Path(__file__).resolve().parents[1] / "backends" / "perf"


def _rows(what: str) -> list[dict]:
    return json.loads((PERF / f"validation_{what}.json").read_text())["rows"]


def test_the_closed_form_rows_are_the_simulator_and_the_cost_model():
    fresh = validate.closed()
    for shipped, made in zip(_rows("closed"), fresh, strict=True):
        assert shipped["check"] == made["check"] and shipped["source"] == made["source"]
        assert shipped["predicted"] == pytest.approx(made["predicted"], rel=1e-12)
        assert math.isclose(shipped["predicted"], shipped["measured"], rel_tol=1e-12)


def test_the_published_rows_are_what_the_simulator_gives():
    for shipped, made in zip(_rows("published"), validate.published(), strict=True):
        assert shipped["predicted"] == pytest.approx(made["predicted"], rel=1e-9), shipped["check"]
        assert shipped["measured"] == made["measured"] and shipped["source"] == made["source"]


def test_the_gpu_rings_are_what_the_simulator_gives():
    rings = [r for r in _rows("gpu") if "ring" in r["check"]]
    assert [int(r["check"].split(", ")[2].split()[0]) for r in rings] == [2, 4, 8]
    for r, p in zip(rings, (2, 4, 8)):
        made = collective_time(cluster("h200"), p, "ring", 256 << 20).seconds * 1e6
        assert r["predicted"] == pytest.approx(made, rel=1e-9)


def test_this_machines_bench_rows_are_what_the_simulator_gives():
    bench = [r for r in _rows("machine") if r["check"].startswith("local bench")]
    assert bench
    for r in bench:
        alg, p, size = r["check"].removeprefix("local bench, ").split(", ")
        nbytes = int(size.split()[0]) << 20
        made = next(x for x in bench_rows(cluster("this-machine"), int(p[2:]), [alg], [nbytes])
                    if x["algorithm"] == alg)
        assert r["predicted"] == pytest.approx(made["time_us"], rel=1e-9), r["check"]


def test_the_goyal_stages_are_resnet50():
    stages = validate.resnet50_stages()
    assert sum(p for p, _ in stages) == 25_557_032  # torchvision's resnet50
    assert sum(m for _, m in stages) == pytest.approx(4.09e9, rel=0.01)
