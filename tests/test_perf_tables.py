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
    shipped = sorted(p.name for p in (ROOT / "backends" / "perf").glob("*.json"))
    named = sorted(set(re.findall(r"<!-- rows: perf/(\S+\.json) -->", text)))
    assert shipped and named == shipped
    for name in shipped:
        meta = json.loads((ROOT / "backends" / "perf" / name).read_text())["meta"]
        assert {"date", "load_average", "cpus"} <= set(meta["measured"]), name
        assert f"--json backends/perf/{name}\n```" in text  # the command above the table


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
    assert "memcpy |" not in out.split("\n| backend")[1].split("\n", 2)[2]  # no memcpy row, only its column
