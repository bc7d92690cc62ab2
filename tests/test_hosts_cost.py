"""The two-level cost model against a real slow link (issue 21, item 4).

The shipped file ``backends/bench/two_level_1gbit.json`` is one run of
``python -m dplab.backends.bench.two_level``: 2 namespace hosts x 2 and x 4 ranks, 1 Gbit/s between
hosts, MPICH (shm inside a host, ofi/tcp between), flat ring, Rabenseifner and hierarchical at
1-64 MiB, with alpha and beta of each link fitted by ``dplab tune``. Two networks:

- ``rank``: a link per rank, as the model assumes (a DGX: one NIC per GPU). Here the targets are
  checked: hierarchical / ring at 16 MiB within 25% of the model's ratio, and every predicted time
  within 25% of the measured one from 16 MiB up. At 1-4 MiB the model is up to 2.6 times too fast,
  and the file's control shows why: with no rate limit at all those all-reduces take most of the
  same time. It is the ranks' per-round cost (2 or 4 ranks per host, 2 shared cores, a loaded
  machine), which a fit over 1-64 MiB does not see, not the link.
- ``host``: one link per host, shared by its ranks. The model, which gives each rank its own port,
  prices the rounds where g ranks of a host cross at once (all of hierarchical's and
  Rabenseifner's crossings) g times too fast; the ring has one crossing per host and stays right.

These tests read the file (fast, no cluster); the ``hosts`` test at the end re-measures the ratio
live, in 2 hosts x 2 ranks, with a generous tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import hosts
import pytest

from dplab.backends.bench import two_level
from dplab.reference.costfit import fit
from dplab.reference.topology import Link, Topology

SHIPPED = Path(two_level.__file__).with_name("two_level_1gbit.json")
DATA = json.loads(SHIPPED.read_text())
MIB = 1 << 20


def _cells(ports: str, g: int | None = None) -> list[dict]:
    return [c for c in DATA["cells"] if c["ports"] == ports and g in (None, c["ranks_per_host"])]


def _cell(ports: str, g: int, algorithm: str, nbytes: int) -> dict:
    return next(c for c in _cells(ports, g) if (c["algorithm"], c["bytes"]) == (algorithm, nbytes))


def _ratio(ports: str, g: int, key: str) -> float:
    return _cell(ports, g, "hierarchical", 16 * MIB)[key] / _cell(ports, g, "ring", 16 * MIB)[key]


def test_the_file_is_one_real_run():
    meta = DATA["meta"]
    assert meta["command"].startswith("python -m dplab.backends.bench.two_level --rate 1gbit")
    assert (
        meta["rate"] == "1gbit"
        and meta["machine"]["cores"] >= 1
        and len(meta["loadavg_1_5_15"]) >= 2
    )
    grid = {(c["ports"], c["ranks_per_host"], c["algorithm"], c["bytes"]) for c in DATA["cells"]}
    assert grid == {(p, g, a, s * MIB) for p in ("rank", "host") for g in (2, 4)
                    for a in two_level.ALGORITHMS for s in (1, 4, 16, 64)}
    for c in DATA["cells"]:
        assert len(c["reps_s"]) == meta["reps"] and c["measured_s"] == min(c["reps_s"])


def test_the_fits_are_dplab_tunes_on_the_rows_kept():
    """Refitting the bench rows in the file as ``dplab tune --from-json`` does gives the saved
    fit."""
    for f in [DATA["fits"]["inter"], *DATA["fits"]["intra"].values()]:
        assert f["commands"][1] == "dplab tune --from-json rows.json --out tune.json"
        again = next(x for x in fit(f["rows"], ("backend",)) if x.algorithm == "all")
        assert again.alpha == pytest.approx(f["alpha_s"], rel=1e-9, abs=1e-12)
        assert again.beta == pytest.approx(f["beta_s_per_byte"], rel=1e-9)
    # the inter fit's bytes crossed the link, the intra fit's did not
    assert DATA["fits"]["inter"]["link_bytes"] > 4 * 64 * MIB
    assert all(f["link_bytes"] < MIB for f in DATA["fits"]["intra"].values())


def test_the_models_numbers_are_todays_model():
    """The file's predictions are what costmodel.cost gives today on the file's fits."""
    for c in DATA["cells"]:
        assert c["model_s"] == pytest.approx(two_level.model(DATA, c), rel=1e-9)


@pytest.mark.parametrize("g", [2, 4])
def test_hierarchical_vs_ring_ratio_at_16mib_matches_the_model(g):
    measured, model = _ratio("rank", g, "measured_s"), _ratio("rank", g, "model_s")
    assert abs(model / measured - 1) <= 0.25, (g, measured, model)


@pytest.mark.parametrize("g", [2, 4])
def test_predicted_times_within_25_percent_from_16mib(g):
    for c in _cells("rank", g):
        if c["bytes"] >= 16 * MIB:
            assert abs(c["model_s"] / c["measured_s"] - 1) <= 0.25, c


def test_a_shared_host_link_is_what_the_model_misses():
    """One link per host: the ring is still priced right; hierarchical and Rabenseifner take about g
    times the model's crossing time, and the model with the link's beta shared by g ranks prices
    them within 25%."""
    for g in (2, 4):
        for c in _cells("host", g):
            if c["bytes"] < 16 * MIB:
                continue
            if c["algorithm"] == "ring":
                assert abs(c["model_s"] / c["measured_s"] - 1) <= 0.25, c
                continue
            assert c["model_s"] / c["measured_s"] < 0.75, c  # the per-rank-port model is too fast
            topo = two_level.topology(DATA, g)
            shared = Topology(
                topo.name, g, topo.intra, Link(topo.inter.alpha, g * topo.inter.beta), 0.0
            )
            assert abs(two_level.model(DATA, c, shared) / c["measured_s"] - 1) <= 0.25, c
        assert _ratio("host", g, "measured_s") > 1.5 * _ratio("host", g, "model_s")


def test_below_16mib_the_time_is_not_the_links():
    """The control: at 1 MiB, taking the rate limit away leaves at least 60% of the time."""
    cells = DATA["control"]["cells"]
    for c in cells:
        if c["rate"] is None and c["bytes"] == MIB:
            limited = next(x for x in cells if x["rate"] == DATA["meta"]["rate"] and all(
                x[k] == c[k] for k in ("ranks_per_host", "algorithm", "bytes")))
            assert c["measured_s"] >= 0.6 * limited["measured_s"], (c, limited)
    misses = [c for c in _cells("rank") if abs(c["model_s"] / c["measured_s"] - 1) > 0.25]
    assert misses and all(c["bytes"] < 16 * MIB and c["model_s"] < c["measured_s"] for c in misses)


# -- live ------------------------------------------------------------------------------------------

@pytest.mark.hosts
@pytest.mark.mpi
def test_live_ratio_of_hierarchical_to_ring_at_16mib(tmp_path):
    """2 hosts x 2 ranks, a link per rank at 1 Gbit/s: hierarchical / ring at 16 MiB measured now is
    within 40% of the model's ratio on the shipped fits (the machine is shared: generous)."""
    hosts.needs_hosts()
    hosts._needs("mpi")
    cells = two_level.measure(
        rate="1gbit",
        ports="rank",
        ranks_per_host=2,
        sizes=[16 * MIB],
        reps=2,
        algorithms=("ring", "hierarchical"),
    )
    got = {c["algorithm"]: c for c in cells}
    measured = got["hierarchical"]["measured_s"] / got["ring"]["measured_s"]
    model = _ratio("rank", 2, "model_s")
    assert abs(model / measured - 1) <= 0.40, (measured, model, cells)
