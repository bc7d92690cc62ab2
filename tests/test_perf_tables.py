"""backends/PERFORMANCE.md's tables are what its shipped ``--json`` rows give, exactly.

A number typed into a table by hand drifts from the run it came from; these tables are made by
``python -m dplab.backends.perf.tables --write backends/PERFORMANCE.md`` and checked here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dplab.backends.perf import tables as perf_tables

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "backends" / "PERFORMANCE.md"


def test_the_tables_are_regenerated_from_the_shipped_rows():
    assert perf_tables.regenerate(PERFORMANCE) == PERFORMANCE.read_text(), (
        "run: python -m dplab.backends.perf.tables --write backends/PERFORMANCE.md")


def test_every_shipped_row_file_has_a_table_its_command_and_its_load():
    text = PERFORMANCE.read_text()
    perf = ROOT / "backends" / "perf"
    shipped = sorted(p.name for p in perf.glob("*.json"))
    named = set(re.findall(r"<!-- rows: perf/(\S+\.json) -->", text))
    validated = set(re.findall(r"<!-- validation: perf/(\S+\.json) -->", text))
    inputs = {a for v in validated for a in json.loads((perf / v).read_text())["meta"]["argv"]
              if a.endswith(".json") and a != v}  # the measured rows a validation is made from
    assert shipped and sorted(named | validated | inputs) == shipped
    for name in shipped:
        meta = json.loads((perf / name).read_text())["meta"]
        assert {"date", "load_average", "cpus"} <= set(meta["measured"]), name
        if name in named:
            assert f"--json backends/perf/{name}\n```" in text  # the command above the table
        elif name in validated:
            assert f"--out backends/perf/{name}\n```" in text


def test_a_bench_table_folds_memcpy_into_a_column(tmp_path):
    rows = [{"backend": "local", "algorithm": a, "world_size": 2, "bytes": 1 << 20, "time_us": t,
             "busbw_gbps": b, "vs_memcpy": b / 20.0, "vs_native": n}
            for a, t, b, n in (("ring", 100.0, 10.0, 0.5), ("native", 50.0, 20.0, 1.0),
                               ("memcpy", 25.0, 20.0, None))]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"meta": {"command": "bench", "argv": ["bench", "--json", "x"]},
                                "rows": rows}))
    perf_tables.stamp(path)
    out = perf_tables.render_rows(path, "rows.json")
    assert "dplab bench --json rows.json" in out and "load average" in out
    assert "| local | ring | 2 | 1 MiB | 100 | 10 | 20 | 0.5 | 0.5 |" in out
    # no memcpy row, only its column
    assert "memcpy |" not in out.split("\n| backend")[1].split("\n", 2)[2]


def test_a_validation_table_gives_each_error_and_their_geometric_mean(tmp_path):
    rows = [{"check": "a", "cluster": "c", "predicted": 1.1, "measured": 1.0, "unit": "ms",
             "source": "s"},
            {"check": "b", "cluster": "c", "predicted": 1.0, "measured": 1.1, "unit": "",
             "source": "s"}]
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"meta": {"command": "validate", "what": "x",
                                         "argv": ["x", "--out", "v.json"]}, "rows": rows}))
    perf_tables.stamp(path)
    out = perf_tables.render_validation(path, "perf/v.json")
    assert "validate x --out perf/v.json" in out and "load average" in out
    assert "| a | c | 1.1 | 1 | ms | +10.0% | s |" in out and "| - | -9.1% |" in out
    assert "Geometric mean of the errors: 10.0% over 2 rows." in out


def test_this_machines_validation_says_each_kinds_error_and_whether_issue_30s_target_is_met(
        tmp_path):
    def row(check, predicted):
        return {"check": check, "cluster": "c", "predicted": predicted, "measured": 1.0,
                "unit": "ms", "source": "s"}

    rows = [row("local bench, ring, p=2, 1 MiB", 1.1), row("local bench, tree, p=2, 4 MiB", 1.1),
            row("local bench, ring, p=4, 1 MiB", 3.0), row("train step, MLP 4M, p=4", 1.0)]
    path = tmp_path / "v.json"
    for what, met in (("machine", "missed"), ("x", None)):
        path.write_text(json.dumps({"meta": {"command": "validate", "what": what,
                                             "argv": [what, "--out", "v.json"]}, "rows": rows}))
        perf_tables.stamp(path)
        out = perf_tables.render_validation(path, "perf/v.json")
        if met is None:  # the other validations have no target of their own here
            assert "By kind" not in out and "target" not in out
            continue
        assert ("By kind and world size (rows): local bench, p=2 10.0% (2); local bench, p=4 "
                "200.0% (1); train step, p=4 0.0% (1). Issue 30's target, 25%: missed.") in out
    path.write_text(json.dumps({"meta": {"command": "validate", "what": "machine",
                                         "argv": ["machine", "--out", "v.json"]},
                                "rows": rows[:2]}))
    perf_tables.stamp(path)
    assert "Issue 30's target, 25%: met." in perf_tables.render_validation(path, "perf/v.json")
