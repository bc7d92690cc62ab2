"""The cost page's model side: curves are costmodel.cost, crossovers agree with a brute-force
scan."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule  # noqa: E402
from dplab.reference.costmodel import closed_form, cost  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.viz.cost import (  # noqa: E402
    CostParams,
    busbw_line,
    curves,
    features,
    format_bytes,
    model_time,
    size_grid,
    to_y,
)
from dplab.viz.cost_crossovers import (  # noqa: E402
    coinciding,
    coinciding_sentence,
    crossovers,
    merged_crossovers,
    tie_tolerance,
    tolerant_sign,
)
from dplab.viz.cost_figure import cost_figure  # noqa: E402

# the crossover mechanics, whatever else is registered
TEXTBOOK = ("naive", "ring", "tree", "direct")


def test_curves_equal_costmodel_at_sample_points():
    params = CostParams(alpha_s=3e-6, beta_gbps=12.5, gamma_gbps=20, world_size=6)
    c = curves(params, points=31)
    assert set(c) == set(ALLREDUCE)
    for alg, (sizes, times) in c.items():
        assert sizes[0] == params.min_bytes and sizes[-1] == params.max_bytes
        for n, t in list(zip(sizes, times))[::5]:
            want = cost(allreduce_schedule(alg, 6), n, 3e-6, 1 / 12.5e9, 1 / 20e9, 4).time
            assert t == want


def test_curves_meet_the_closed_forms_where_the_chunks_divide():
    params = CostParams(alpha_s=2e-6, beta_gbps=4, world_size=8)
    n = 8 * 4 * 1000  # whole elements in every chunk
    for alg in ("ring", "tree", "naive", "direct"):
        assert model_time(alg, n, params) == pytest.approx(closed_form(alg, 8, n, 2e-6, 1 / 4e9, 0))


LINEAR = ("naive", "ring", "tree", "direct", "recursive_doubling", "rabenseifner")


@pytest.mark.parametrize("alg", list(ALLREDUCE))
@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_model_is_linear_in_alpha_and_beta_where_one_rank_is_slowest_for_both(alg, p):
    """time = a * alpha + b * beta exactly when the rank that pays the most messages in a round also
    moves the most bytes: the textbook schedules. The pipelined and two-level ones (and uneven
    chunks) can have one rank slowest for alpha and another for beta, and the max of sums is then
    below the sum of maxes: the fit (reference/costfit.py) takes its slopes at each point
    instead."""
    for n in (4, 100, 4100, 1 << 20):
        a, b = features(alg, p, n)
        t = cost(allreduce_schedule(alg, p), n, 7e-6, 3e-10, 0, 4).time
        if alg in LINEAR:
            assert t == pytest.approx(7e-6 * a + 3e-10 * b, rel=1e-12)
        else:
            assert max(7e-6 * a, 3e-10 * b) <= t * (1 + 1e-9) and t <= (7e-6 * a + 3e-10 * b) * (
                1 + 1e-9
            )
        g = cost(allreduce_schedule(alg, p), n, 0, 0, 1, 4).time
        if alg == "recursive_doubling":  # it adds every byte it receives, but the fold's copy back
            assert g == pytest.approx(b - n * (p & (p - 1) != 0))
        elif alg in LINEAR:
            assert g == pytest.approx(b / 2)
        else:  # a rank adds at most what it receives
            assert g <= b * (1 + 1e-12)


def test_tree_beats_ring_below_the_closed_form_crossover():
    """ring 14α + 1.75nβ, tree 6α + 6nβ at p=8: they cross at n = 8α / 4.25β."""
    params = CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8, algorithms=("ring", "tree"))
    (x,) = crossovers(params)
    assert (x.faster_below, x.faster_above, x.world_size) == ("tree", "ring", 8)
    assert abs(x.nbytes - 8 * 5e-6 / (4.25 * 1e-10)) <= 8 * 4
    assert x.sentence() == "tree beats ring below 91.9 KiB at p=8"


def _brute_force(params, lo, hi):
    """Every element from lo to hi: brackets (last size a clearly wins, first size b clearly
    wins)."""
    sizes = range(lo, hi + 1, params.itemsize)
    times = {a: [model_time(a, n, params) for n in sizes] for a in params.algorithms}
    found = {}
    for a, b in [
        (a, b) for i, a in enumerate(params.algorithms) for b in params.algorithms[i + 1 :]
    ]:
        tol, last = tie_tolerance(a, b, params), None
        for n, ta, tb in zip(sizes, times[a], times[b]):
            s = 0 if abs(ta - tb) <= tol else (1 if ta > tb else -1)
            assert n % 97 or s == tolerant_sign(a, b, n, params)  # spot-check the module's own sign
            if s == 0:
                continue
            if last is not None and s != last[1]:
                found.setdefault((a, b), []).append((last[0], n))
            last = (n, s)
    return found


# Each scan prices every element from 4 B to 16 KiB (~12 CPU-s): the default tier runs the one with
# a reduction cost at a world size that is not a power of two; the rest are exhaustive variants.
@pytest.mark.parametrize("p, alpha, gamma", [
    pytest.param(4, 1e-7, None, marks=pytest.mark.slow),  # slow: p a power of two, no gamma
    pytest.param(5, 2e-7, None, marks=pytest.mark.slow),  # slow: another p, no gamma
    (6, 1e-7, 8.0),
    pytest.param(8, 5e-8, None, marks=pytest.mark.slow),  # slow: p a power of two, no gamma
])
def test_crossovers_agree_with_a_brute_force_scan(p, alpha, gamma):
    params = CostParams(alpha_s=alpha, beta_gbps=10, gamma_gbps=gamma, world_size=p,
                        min_bytes=4, max_bytes=16 << 10)
    got = crossovers(params, points=61)
    brute = _brute_force(params, 4, 16 << 10)
    assert sum(len(v) for v in brute.values()) == len(got) >= 1
    for x in got:
        pair = next(k for k in brute if set(k) == {x.faster_below, x.faster_above})
        (left, right), = [br for br in brute[pair] if br[0] < x.nbytes <= br[1]]
        a, b = x.faster_below, x.faster_above
        # exact order changes at n: a ahead (or tied) just below, b strictly ahead at n
        assert model_time(a, x.nbytes - 4, params) <= model_time(b, x.nbytes - 4, params)
        assert model_time(b, x.nbytes, params) < model_time(a, x.nbytes, params)
        assert model_time(a, left, params) < model_time(b, left, params)


def test_ring_and_direct_tie_instead_of_crossing_at_every_remainder():
    params = CostParams(world_size=8, algorithms=("ring", "direct"))
    assert crossovers(params) == []
    assert model_time("ring", 8 * 4 * 999, params) == pytest.approx(
        model_time("direct", 8 * 4 * 999, params)
    )


def test_coinciding_curves_are_the_ties_at_every_size():
    assert coinciding(CostParams(world_size=8)) == [("ring", "direct")]
    # 4α, 4nβ each
    assert coinciding(CostParams(world_size=3)) == [("naive", "tree"), ("ring", "direct")]
    assert coinciding(CostParams(world_size=8, algorithms=("tree", "ring"))) == []
    assert coinciding_sentence([], 8) is None
    assert coinciding_sentence([("ring", "direct")], 8) == (
        "ring and direct cost the same at every size at p=8 (within one element per message), so "
        "their curves coincide: direct is drawn dashed over ring.")
    assert coinciding_sentence(coinciding(CostParams(world_size=3)), 3).endswith(
        "coincide: tree and direct are drawn dashed over naive and ring.")


def test_crossovers_of_coinciding_curves_merge_into_one_sentence():
    params = CostParams(world_size=8, algorithms=TEXTBOOK)
    pairs = crossovers(params)
    assert [x.sentence() for x in pairs] == ["tree beats direct below 91.9 KiB at p=8",
                                             "tree beats ring below 91.9 KiB at p=8"]
    (m,) = merged_crossovers(params)
    assert (m.faster_below, m.faster_above, m.world_size) == (("tree",), ("ring", "direct"), 8)
    assert m.nbytes == min(x.nbytes for x in pairs) and set(m.parts) == set(pairs)
    assert m.sentence() == "tree beats ring and direct below 91.9 KiB at p=8"
    # without the tie there is nothing to merge: the pair's own crossover, same size and words
    (alone,) = merged_crossovers(CostParams(world_size=8, algorithms=("ring", "tree")))
    assert alone.sentence() == "tree beats ring below 91.9 KiB at p=8" and len(alone.parts) == 1


def test_figure_dashes_the_coinciding_curve_and_draws_one_marker():
    params = CostParams(world_size=8, algorithms=TEXTBOOK)
    fig = cost_figure(params, points=41)
    by_name = {t.name: t for t in fig.data}
    ring, direct = by_name["ring (model)"], by_name["direct = ring (model)"]
    assert ring.line.dash == "solid" and direct.line.dash == "dash"
    assert list(direct.y) == pytest.approx(list(ring.y), rel=1e-3)  # the same curve, both visible
    marks = by_name["crossovers"]
    assert marks.text == ("<b>1</b>",) and marks.hovertext == (
        "tree beats ring and direct below 91.9 KiB at p=8",)
    assert marks.y[0] == pytest.approx(model_time("tree", marks.x[0], params) * 1e6)
    assert fig.layout.legend.y > 1 and fig.layout.legend.yanchor == "bottom"  # above the plot


def test_no_crossover_where_one_algorithm_always_wins():
    # tree = naive, ring cheapest (4 alpha each, ring: fewer bytes)
    assert crossovers(CostParams(world_size=2, algorithms=TEXTBOOK)) == []
    assert crossovers(CostParams(world_size=3, algorithms=TEXTBOOK)) == []


def test_busbw_is_algbw_times_the_ring_factor():
    y_alg = to_y([1 << 20], [1e-3], 8, "algbw")
    y_bus = to_y([1 << 20], [1e-3], 8, "busbw")
    assert y_alg[0] == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert y_bus[0] == pytest.approx(y_alg[0] * 1.75)
    assert to_y([1], [2e-6], 8, "time")[0] == pytest.approx(2.0)
    assert "× 1.75 at p=8" in busbw_line(8)
    with pytest.raises(ConfigError, match="y axis"):
        to_y([1], [1], 2, "latency")


def test_figure_holds_the_model_curves_and_the_crossover_marks():
    params = CostParams(world_size=8, algorithms=("ring", "tree"))
    fig = cost_figure(params, y="busbw", points=41)
    names = [t.name for t in fig.data]
    assert names == ["ring (model)", "tree (model)", "crossovers"]
    ring = fig.data[0]
    n = ring.x[10]
    assert ring.y[10] == pytest.approx(n / model_time("ring", n, params) / 1e9 * 1.75)
    assert fig.data[2].hovertext == ("tree beats ring below 91.9 KiB at p=8",)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.title.text == "busbw (GB/s)"


def test_figure_overlays_measured_rows_of_this_world_size_and_fitted_lines():
    rows = [
        {
            "backend": "local",
            "algorithm": "ring",
            "world_size": 4,
            "bytes": n,
            "time_us": 10 + n / 1e3,
        }
        for n in (4096, 65536)
    ] + [{"backend": "local", "algorithm": "ring", "world_size": 2, "bytes": 4096, "time_us": 5.0}]
    params = CostParams(world_size=4, algorithms=("ring",))
    fig = cost_figure(params, measured=rows, fitted={("local", "ring"): (1e-6, 1e-9)})
    meas = next(t for t in fig.data if t.name == "ring (local, measured)")
    assert list(meas.x) == [4096, 65536] and list(meas.y) == pytest.approx([14.096, 75.536])
    fitted = next(t for t in fig.data if t.name == "ring (local, fitted)")
    a, b = features("ring", 4, 4096)
    assert fitted.y[0] == pytest.approx((1e-6 * a + 1e-9 * b) * 1e6)


def test_sizes_and_bytes_as_words():
    grid = size_grid(CostParams(min_bytes=1024, max_bytes=1 << 20), points=11)
    assert grid[0] == 1024 and grid[-1] == 1 << 20 and all(n % 4 == 0 for n in grid)
    assert grid == sorted(set(grid)) and math.isclose(grid[5], 32768, rel_tol=0.01)
    assert [format_bytes(n) for n in (96 << 10, 94128, 3, 1 << 30)] == [
        "96 KiB",
        "91.9 KiB",
        "3 B",
        "1 GiB",
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 1}, "world size"),
        ({"beta_gbps": 0}, "beta"),
        ({"min_bytes": 8, "max_bytes": 8}, "sizes"),
        ({"algorithms": ("native",)}, "no cost model"),
    ],
)
def test_bad_parameters_say_what_to_do(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CostParams(**kwargs)
