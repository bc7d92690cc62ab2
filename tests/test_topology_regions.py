"""The best algorithm per (p, size) region: the pure function, the heat map, and the Cost page
section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.costmodel import best_regions, curve, region_algorithms
from dplab.reference.topology import PRESETS

PS, SIZES = (2, 8, 16, 64), (1 << 10, 1 << 20, 1 << 30)


def test_regions_are_the_cheapest_curve_and_show_why_engines_switch():
    topo = PRESETS["dgx-h100"]
    r = best_regions(topo, PS, SIZES)
    assert "hierarchical:8" in r.algorithms and "hierarchical" not in r.algorithms
    for a, name in enumerate(r.algorithms):
        want = curve(allreduce_schedule(name, 64), SIZES, topo, 4)
        np.testing.assert_allclose(r.times[a, 3], want, rtol=1e-12)
    names = [[r.algorithms[w] for w in row] for row in r.winner]
    assert names[3][0] == "recursive_doubling"  # small: fewest rounds (lg p alphas)
    assert names[3][2] == "hierarchical:8"  # large, 8 nodes: a g-th of the bytes on InfiniBand
    assert names[1][2] == "rabenseifner"  # large, one node: bandwidth-optimal in 2 lg p rounds
    assert "hierarchical:8" in r.table() and r.table().count("\n") == len(PS)
    flat = best_regions(PRESETS["flat-10g"], PS, SIZES)
    assert "hierarchical" not in " ".join(region_algorithms(PRESETS["flat-10g"]))
    assert {flat.algorithms[w] for w in flat.winner[:, 2]} <= {"rabenseifner", "recursive_doubling"}


def test_heat_map_colours_the_winners():
    pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")
    from dplab.viz.cost_regions import regions_figure, regions_rows

    r = best_regions(PRESETS["dgx-h100"], PS, SIZES)
    fig = regions_figure(r)
    heat = fig.data[0]
    assert list(heat.y) == [str(p) for p in PS] and list(heat.x) == ["1 KiB", "1 MiB", "1 GiB"]
    ticks = list(heat.colorbar.ticktext)
    assert [[ticks[z] for z in row] for row in heat.z] == [
        [r.algorithms[w] for w in row] for row in r.winner
    ]
    assert regions_rows(r)[3] == {"p": "64", "1 KiB": "recursive_doubling", "1 MiB": "rabenseifner",
                                  "1 GiB": "hierarchical:8"}


def test_cost_page_maps_the_regions_of_the_chosen_topology():
    pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "viz" / "pages" / "cost.py"),
                           default_timeout=120)
    at.query_params["algorithms"] = "ring,tree,hierarchical"  # the curves above: keep them cheap
    at.run()
    assert not at.exception
    # off until asked
    assert not [c for c in at.get("plotly_chart") if "cost_regions" in c.proto.id]
    at.toggle(key="regions_on").set_value(True).run()
    at.selectbox(key="regions_topology").set_value("dgx-h100").run()
    at.select_slider(key="regions_max_p").set_value(16).run()
    assert not at.exception
    chart = next(c for c in at.get("plotly_chart") if "cost_regions" in c.proto.id)
    spec = json.loads(chart.proto.spec)
    assert spec["data"][0]["y"] == ["2", "4", "8", "16"]
    assert "hierarchical:8" in spec["data"][0]["colorbar"]["ticktext"]
    assert any("DGX H100" in c.value for c in at.caption)


def test_the_engines_array_builders_price_exactly_as_the_readable_ones():
    """The app prices the p^2 schedules with the engine's array builders (the readable ones take
    seconds at p = 1024): the map must be the same to the bit."""
    from dplab.backends.fastpath.arrays import ALLREDUCE as arrays

    topo = PRESETS["dgx-h100"]
    algorithms = ("ring", "direct", "rabenseifner", "pipelined_ring", "hierarchical:8", "tree")
    readable = best_regions(topo, PS, SIZES, algorithms=algorithms)
    fast = best_regions(topo, PS, SIZES, algorithms=algorithms, builders=arrays)
    assert np.array_equal(readable.times, fast.times)
