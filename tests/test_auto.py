"""algorithm="auto": the cheapest registered all-reduce by the saved fit, the same on every rank."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

# the engine's allreduce resolves "auto"; the spine's refuses it
from dplab.backends import allreduce, launch
from dplab.backends.launch.world import RankError
from dplab.reference import auto
from dplab.reference.algorithms import ALLREDUCE, has_schedule, ring
from dplab.reference.costfit import CostFit
from dplab.reference.errors import ConfigError
from dplab.reference.train.sync import SyncConfig

SMALL, LARGE = 4096, 16 << 20


def tuning(*fits):
    return auto.Tuning(tuple(CostFit(*f) for f in fits), "test")


def write(tmp_path, name, *fits):
    path = tmp_path / name
    auto.save_tuning(tuning(*fits), path)
    return path


@pytest.fixture
def tune_env(monkeypatch, tmp_path):
    """Point $DPLAB_TUNE at a file of the test's own and forget what was read before and after."""
    def use(*fits):
        path = write(tmp_path, "tune.json", *fits)
        monkeypatch.setenv(auto.TUNE_ENV, str(path))
        auto.reset()
        return path
    yield use
    auto.reset()


def test_the_cheapest_candidate_wins_and_switches_with_size():
    t = tuning(("local", "all", "all", 50e-6, 1e-10, None))
    # latency-bound: fewest rounds; bandwidth-bound: the least bytes on the critical path
    small = {alg: t.predict_s("local", alg, 8, SMALL) for alg in ALLREDUCE}
    large = {alg: t.predict_s("local", alg, 8, LARGE) for alg in ALLREDUCE}
    assert t.choose("local", 8, SMALL) == min(
        small, key=lambda a: (small[a], list(ALLREDUCE).index(a))
    )
    assert t.choose("local", 8, LARGE) == min(
        large, key=lambda a: (large[a], list(ALLREDUCE).index(a))
    )
    assert small[t.choose("local", 8, SMALL)] < small["ring"]  # ring's 14 rounds lose at 4 KiB
    # tree's 2 lg p full buffers lose at 16 MiB
    assert large[t.choose("local", 8, LARGE)] < large["tree"]


def test_the_most_specific_fit_prices_each_candidate_and_native_needs_its_own():
    t = tuning(("mpi", "all", "all", 10e-6, 1e-10, None), ("mpi", 4, "all", 20e-6, 1e-10, None),
               ("mpi", 4, "tree", 1e-9, 1e-13, None), ("mpi", "all", "native", 1e-6, 1e-11, None))
    assert t.fit_for("mpi", "tree", 4).alpha == 1e-9
    assert t.fit_for("mpi", "ring", 4).alpha == 20e-6
    assert t.fit_for("mpi", "ring", 2).alpha == 10e-6
    assert t.fit_for("mpi", "native", 4).alpha == 1e-6
    assert t.choose("mpi", 4, SMALL) == "tree"  # its own (very cheap) fit
    assert t.choose("mpi", 2, LARGE) == "native"
    no_native = tuning(("mpi", "all", "all", 10e-6, 1e-10, None))
    assert (
        "native" not in no_native.candidates("mpi")
        and no_native.fit_for("mpi", "native", 2) is None
    )
    assert tuning().choose("torch-nccl", 8, SMALL) == "native"  # nothing fitted: the engine's own


def test_native_is_priced_with_its_shape_check_where_that_is_one_more_engine_call():
    fits = [(b, "all", f, alpha, 1e-11, None) for b in ("local", "mpi")
            for f, alpha in (("native", 10e-6), ("all", 25e-6))]
    t = tuning(*fits)
    check = t.fit_for("mpi", "native", 2).predict_s("native", 2, 32, 8)
    assert t.predict_s("mpi", "native", 2, SMALL) == pytest.approx(
        t.fit_for("mpi", "native", 2).predict_s("native", 2, SMALL) + check)
    assert t.predict_s("local", "native", 2, SMALL) == t.fit_for("local", "native", 2).predict_s(
        "native", 2, SMALL)  # the local backend's check is a tag: free
    assert t.choose("local", 2, SMALL) == "native" and t.choose("mpi", 2, SMALL) != "native"


def test_new_registry_entries_join_without_a_change_here(monkeypatch):
    monkeypatch.setitem(ALLREDUCE, "ring_again", ring.allreduce)
    t = tuning(
        ("local", "all", "all", 10e-6, 1e-10, None),
        ("local", "all", "ring_again", 1e-9, 1e-12, None),
    )
    assert "ring_again" in t.candidates("local") and t.choose("local", 4, LARGE) == "ring_again"


def test_where_some_were_measured_only_those_compete():
    # the coarse fit alone makes every unmeasured schedule look 1000x cheaper than measured tree
    t = tuning(("local", "all", "all", 1e-9, 1e-14, None), ("local", 2, "tree", 1e-6, 1e-11, None),
               ("local", 2, "naive", 2e-6, 1e-11, None))
    assert t.candidates("local") == ["naive", "tree"] and t.choose("local", 2, SMALL) == "tree"
    assert tuning(("local", "all", "all", 1e-9, 1e-14, None)).candidates("local") == list(ALLREDUCE)


def test_ties_go_to_the_first_registered():
    t = tuning(("local", "all", "all", 0.0, 0.0, None))
    assert t.choose("local", 4, SMALL) == next(iter(ALLREDUCE))


def test_has_schedule_and_configs_accept_auto_for_all_reduce_only():
    assert (
        has_schedule("auto") and not has_schedule("auto", "scatter") and not has_schedule("auto:2")
    )
    SyncConfig("auto").validate(4)


def test_the_saved_file_round_trips_and_a_bad_one_says_what_to_do(tmp_path, monkeypatch):
    path = write(tmp_path, "t.json", ("local", 2, "ring", 1e-5, 2e-10, 3e-11))
    back = auto.load_tuning(path)
    assert back.fits[0].to_json() == CostFit("local", 2, "ring", 1e-5, 2e-10, 3e-11).to_json()
    assert back.source == str(path)
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "fits": [{"backend": "x"}]}))
    with pytest.raises(ConfigError, match="dplab tune"):
        auto.load_tuning(tmp_path / "bad.json")
    monkeypatch.setenv(auto.TUNE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="no tune file"):
        auto.load_tuning()
    monkeypatch.setenv(auto.TUNE_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/dplab/tune.json: the built-in fit
    assert auto.tune_path() == tmp_path / ".cache/dplab/tune.json"
    assert auto.load_tuning().source == "built-in defaults"


def test_the_choice_is_cached_and_costs_about_a_dictionary_lookup(tune_env, monkeypatch):
    tune_env(("local", "all", "all", 10e-6, 1e-10, None))

    class Comm:
        backend, world_size = "local", 4

    buf = np.zeros(1024, np.float32)
    first = auto.chosen(Comm, buf)
    calls = []
    monkeypatch.setattr(auto.Tuning, "choose", lambda *a: calls.append(a) or "naive")
    t0 = time.perf_counter()
    for _ in range(10_000):
        assert auto.chosen(Comm, buf) == first
    per_call = (time.perf_counter() - t0) / 10_000
    # measured ~1 µs here; the bound allows a loaded machine
    assert calls == [] and per_call < 20e-6


def _auto_sum(comm, sizes):
    comm.tracer.enabled = True
    out = []
    for n in sizes:
        x = np.arange(n, dtype=np.float64) + comm.rank
        allreduce(comm, x, "auto")
        span = [e for e in comm.tracer.take() if e.kind == "allreduce"][-1]
        out.append(
            (span.algorithm, auto.chosen(comm, x), float(np.abs(x - (3 * np.arange(n) + 3)).max()))
        )
    return out


def test_auto_runs_the_chosen_schedule_on_every_rank_and_the_trace_names_it(tune_env, backend):
    # tree is cheap per message, ring per byte: small buffers go to tree, large ones to ring
    tune_env(*[f for b in ("local", "mpi", "torch", "cuda", "sim") for f in (
        (b, 3, "tree", 1e-6, 1e-9, None), (b, 3, "ring", 1e-4, 1e-11, None),
        (b, "all", "all", 1.0, 1.0, None))])
    results = launch(_auto_sum, 3, backend=backend, args=((10, 1 << 18),))
    for per_rank in results:
        assert per_rank == [("tree", "tree", 0.0), ("ring", "ring", 0.0)]


def _auto_with_own_file(comm, paths):
    os.environ[auto.TUNE_ENV] = paths[comm.rank]
    auto.reset()
    allreduce(comm, np.ones(64), "auto")


def test_ranks_that_read_different_fits_are_told_not_left_waiting(tmp_path):
    paths = [
        str(
            write(
                tmp_path,
                f"{r}.json",
                ("local", "all", alg, 1e-6, 1e-10, None),
                ("local", "all", "all", 1.0, 1.0, None),
            )
        )
        for r, alg in enumerate(("tree", "ring"))
    ]
    with pytest.raises(RankError, match=r"called allreduce\((tree|ring)\) but rank \d called "
                                        r"allreduce"):
        launch(_auto_with_own_file, 2, args=(paths,), timeout=20)


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_training_with_auto_equals_one_device(tune_env, backend):
    from dplab.backends.launch.world import BackendUnavailable, check_backend
    from dplab.backends.runs import RunSpec, run_train

    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    tune_env(("local", "all", "all", 10e-6, 1e-10, None), ("mpi", "all", "all", 10e-6, 1e-10, None))
    row, events = run_train(RunSpec(backend, 3, "auto", bucket_cap_mb=0.0005), trace=True)
    assert (
        row["algorithm"] == "auto"
        and row["max_abs_diff_vs_single"] < 1e-10
        and row["ranks_identical"]
    )
    spans = [e for rank in events for e in rank if e.kind == "allreduce"]
    ran = {e.algorithm for e in spans}  # what auto ran, by the same fit, for each bucket's bytes
    assert (
        ran
        and ran <= set(ALLREDUCE)
        and ran == {auto.load_tuning().choose(backend, 3, e.bytes, 8) for e in spans}
    )


class _StubOpt:
    def step(self, master, grad):
        master -= grad


def _amp_step_with_an_inf_on_rank_0(comm, algorithm):
    """As if an engine's all-reduce had left different bits on each rank:
    only rank 0 sees an inf."""
    from dplab.reference.precision import Amp, MixedPrecision

    master = np.ones(4, np.float32)
    amp = Amp(comm, SyncConfig(algorithm, precision=MixedPrecision()), master)
    grad = np.full(4, np.inf if comm.rank == 0 else 1.0, np.float32)
    return amp.step(_StubOpt(), master, grad, 0)


@pytest.mark.parametrize("algorithm", ["native", "auto"])
def test_mixed_precision_under_auto_agrees_on_overflow_as_under_native(algorithm, tune_env):
    # auto may run the engine's own all-reduce, so, as for native, the overflow flag is all-reduced
    tune_env(("local", "all", "native", 1e-9, 1e-13, None), ("local", "all", "all", 1.0, 1.0, None))
    assert launch(_amp_step_with_an_inf_on_rank_0, 2, args=(algorithm,)) == [False, False]


def _ddp_grad(comm):
    torch = pytest.importorskip("torch")
    from dplab.backends.nn.ddp import DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(3, 2, dtype=torch.float64), comm, algorithm="auto")
    x = torch.full((1, 3), float(comm.rank + 1), dtype=torch.float64)
    ddp(x).sum().backward()
    return ddp.module.weight.grad.numpy().copy()


@pytest.mark.parametrize("backend", ["local", pytest.param("torch", marks=pytest.mark.torch)])
def test_ddp_takes_auto_and_averages_gradients(tune_env, backend):
    # (MPI: the same allreduce call, covered above; its ranks cost ~10 s here)
    pytest.importorskip("torch")
    tune_env(*[(b, "all", "all", 10e-6, 1e-10, None) for b in ("local", "mpi", "torch")])
    grads = launch(_ddp_grad, 2, backend=backend)
    for g in grads:  # d(sum(W x))/dW = x: rank r's x is r + 1 everywhere, the mean is 1.5
        np.testing.assert_array_equal(g, np.full((2, 3), 1.5))
