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
