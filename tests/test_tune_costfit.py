"""reference/costfit: the cost model's terms, and alpha, beta, gamma fitted to bench rows."""

from __future__ import annotations

import random

import pytest

from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule
from dplab.reference.costfit import CostFit, fit, terms
from dplab.reference.costmodel import cost

SIZES = (4096, 65536, 1 << 20, 16 << 20)


def synthetic(backend, alg, p, alpha, beta, gamma, sizes=SIZES):
    return [{"backend": backend, "algorithm": alg, "world_size": p, "bytes": n,
             "time_us": 1e6 * CostFit(backend, p, alg, alpha, beta, gamma).predict_s(alg, p, n)}
            for n in sizes]


def reduce_share(alg, p=4, n=1 << 20):
    _, b, c = terms(alg, p, n)
    return c / b


@pytest.mark.parametrize("alg", sorted(ALLREDUCE))
def test_terms_are_the_cost_model_at_every_point(alg):
    """a alpha + b beta + c gamma is cost()'s walk of the schedule, wherever it is evaluated."""
    rng = random.Random(alg)
    for p in range(1, 10):
        s = allreduce_schedule(alg, p)
        for _ in range(4):
            n = rng.choice([0, 4, 12, 4096, 65536 + 12, 1 << 20])
            point = (rng.uniform(1e-7, 1e-4), rng.uniform(1e-12, 1e-9), rng.uniform(0, 1e-9))
            a, b, c = terms(alg, p, n, 4, point)
            assert a * point[0] + b * point[1] + c * point[2] == pytest.approx(
                cost(s, n, *point, itemsize=4).time, rel=1e-12, abs=1e-18)


def test_ring_terms_are_the_textbook_counts():
    a, b, c = terms("ring", 4, 1 << 20)
    assert (a, b, c) == (6, 2 * 3 / 4 * (1 << 20), 3 / 4 * (1 << 20))


def test_alpha_beta_gamma_are_recovered_when_the_rows_can_tell_gamma_from_beta():
    shares = {alg: reduce_share(alg) for alg in ALLREDUCE}
    other = sorted(a for a, s in shares.items() if abs(s - shares["ring"]) > 0.1)
    if not other:
        pytest.skip("every registered schedule reduces the same share of what it sends: gamma is "
                    "not identifiable (recursive doubling would separate it)")
    truth = (20e-6, 1 / 8e9, 1 / 30e9)
    rows = [
        r
        for alg in ("ring", "tree", other[0])
        for p in (2, 4)
        for r in synthetic("mpi", alg, p, *truth)
    ]
    (f,) = fit(rows)
    assert (f.backend, f.world_size, f.algorithm, len(f.rows)) == ("mpi", "all", "all", 24)
    assert f.alpha == pytest.approx(truth[0], rel=1e-9)
    assert f.beta == pytest.approx(truth[1], rel=1e-9)
    assert f.gamma == pytest.approx(truth[2], rel=1e-9)
    s = f.summary()
    assert s["gamma_gbps"] == pytest.approx(30) and s["max_residual_pct"] < 1e-7 and s["note"] == ""


def test_schedules_with_one_reduce_share_fold_gamma_into_beta():
    truth = (20e-6, 1 / 8e9, 1 / 30e9)
    rows = [r for alg in ("ring", "tree", "naive") for r in synthetic("local", alg, 4, *truth)]
    (f,) = fit(rows)
    assert f.gamma is None and "gamma folded into beta" in f.note
    # these schedules reduce half of what they send: beta absorbs gamma / 2, exactly
    assert f.alpha == pytest.approx(truth[0], rel=1e-9)
    assert f.beta == pytest.approx(truth[1] + truth[2] / 2, rel=1e-9)
    assert f.summary()["max_residual_pct"] < 1e-7


def test_native_is_fitted_on_its_own_and_memcpy_not_at_all():
    rows = synthetic("mpi", "ring", 4, 10e-6, 1e-10, 0.0) + synthetic(
        "mpi", "native", 4, 3e-6, 2e-10, 0.0
    )
    rows.append(
        {"backend": "mpi", "algorithm": "memcpy", "world_size": 4, "bytes": 4096, "time_us": 0.5}
    )
    rows.append(
        {"backend": "mpi", "algorithm": "ring", "world_size": 1, "bytes": 4096, "time_us": 0.5}
    )
    fits = {f.algorithm: f for f in fit(rows, by=("backend", "world_size"))}
    assert set(fits) == {"all", "native"} and fits["native"].world_size == 4
    assert fits["native"].alpha == pytest.approx(3e-6) and fits["native"].beta == pytest.approx(
        2e-10
    )
    assert fits["all"].alpha == pytest.approx(10e-6) and len(fits["all"].rows) == 4


def test_no_value_comes_out_negative_and_the_note_says_which_was_clamped():
    # times that fall with size: the unconstrained line has a negative beta
    rows = [{"backend": "local", "algorithm": "ring", "world_size": 2, "bytes": n, "time_us": t}
            for n, t in ((4096, 50.0), (65536, 45.0), (1 << 20, 40.0))]
    (f,) = fit(rows, by=("backend", "algorithm"))
    assert f.alpha > 0 and f.beta == 0 and "beta set to 0" in f.note
    assert f.alpha * 1e6 * terms("ring", 2, 4096)[0] == pytest.approx(45.0, rel=0.05)
    (raw,) = fit(rows, by=("backend", "algorithm"), nonnegative=False)
    assert raw.beta < 0 and "negative value" in raw.note


def test_grouping_by_world_size_and_algorithm_and_the_saved_form():
    rows = [r for alg, p, alpha, beta in (("ring", 2, 10e-6, 1e-10), ("ring", 4, 30e-6, 1e-10),
                                          ("tree", 4, 30e-6, 3e-10))
            for r in synthetic("local", alg, p, alpha, beta, 0.0)]
    fits = fit(rows, by=("backend", "world_size", "algorithm"))
    assert [(f.world_size, f.algorithm) for f in fits] == [(2, "ring"), (4, "ring"), (4, "tree")]
    assert [round(f.alpha * 1e6, 6) for f in fits] == [10, 30, 30]
    back = CostFit.from_json(fits[2].to_json())
    assert (back.alpha, back.beta, back.world_size) == (fits[2].alpha, fits[2].beta, 4)
    assert back.predict_s("tree", 4, 1 << 20) == pytest.approx(
        fits[2].predict_s("tree", 4, 1 << 20)
    )
    (one,) = fit(rows[:1])
    assert one.alpha is None and "two sizes" in one.note
