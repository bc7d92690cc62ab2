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


def test_one_process_alone_is_a_drift_row_beside_this_machines_validation_not_in_its_mean(
        tmp_path):
    from dplab.backends.perf import tables

    scaling = [{"model": "4M", "world_size": w, "step_ms": ms} for w, ms in ((1, 70.0), (2, 40.0))]
    ddp = [{"impl": i, "world_size": w, "global_batch": b, "step_ms": ms}
           for i, w, b, ms in (("single", 1, 32, 50.0), ("independent", 2, 64, 55.0),
                               ("dplab", 2, 64, 60.0))]
    measured = [dict(r, step_ms=r["step_ms"] * 2) for r in scaling]
    rows = validate._pairs("scaling", measured, scaling, "s")
    rows += validate._pairs("scaling", [dict(r, step_ms=r["step_ms"] * 1.25) for r in ddp], ddp,
                            "s")
    assert [(r["check"], r.get("drift", False)) for r in rows] == [
        ("train step, MLP 4M, batch 64, one process", True),
        ("train step, MLP 4M, batch 64, p=2", False),
        ("DDP's MLP in one process, batch 32", True),
        ("DDP step, 10.5 M-parameter MLP, batch 64, p=2", False)]
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"meta": {"command": "validate", "what": "machine",
                                         "argv": ["machine", "--out", "v.json"]}, "rows": rows}))
    tables.stamp(path)
    out = tables.render_validation(path, "perf/v.json")
    # the mean over the two validated rows (errors -50% and -20%): exp((ln 2 + ln 1.25) / 2) - 1
    assert "Geometric mean of the errors: 58.1% over 2 rows." in out
    assert "| train step, MLP 4M, batch 64, one process (drift: not in the mean) |" in out
    assert ("(drift, not validation): train step, MLP 4M, batch 64, one process -50.0%; DDP's "
            "MLP in one process, batch 32 -20.0%.") in out
