"""Stragglers, backup workers and time budgets: they change WHEN things happen, never WHAT.

A straggler must really slow its own rank (and, in sync, everyone who waits for it);
sync with a straggler must still equal single-device training; an async or backup-worker
run must still replay exactly from its log; backup workers must drop the slow worker's
gradients and rescale the rest as documented; a time budget must stop every rank at the
same step without a hang; and ``dplab compare`` must race the modes against the clock.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from dplab.backends.cli.commands import main
from dplab.backends.launch.world import RankError
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, compute_gradient, train_async, worker_batch
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.train.straggler import Slowdown, check_stragglers, parse_stragglers
from dplab.reference.train.sync import SyncConfig, train_sync

SMALL = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                    global_batch=12, steps=5, seed=3)
# About a millisecond of compute per shard, in matrices small enough (64 x 64 x 64) that
# BLAS stays single-threaded: its spinning threads would blur every timing on two cores.
HEAVY = TrainConfig(model=MLPConfig(in_dim=64, hidden=(64,) * 4, out_dim=8), num_samples=512,
                    global_batch=128, steps=8, seed=1)


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(
        np.max(np.abs(a - b), initial=0.0) / max(1.0, float(np.max(np.abs(b), initial=0.0)))
    )


def span_s(events, rank: int, kinds: tuple[str, ...]) -> float:
    return (
        sum(e.t_end_ns - e.t_start_ns for e in events if e.rank == rank and e.kind in kinds) / 1e9
    )


# -- rank functions (module level: World.run pickles them) -----------------------------------

def _run(comm, trainer, cfg, config, trace=False):
    """``trainer(comm, cfg, config)`` on this rank; with ``trace``, also this run's trace events."""
    comm.tracer.take()
    comm.tracer.enabled = trace
    try:
        result = trainer(comm, cfg, config)
    finally:
        comm.tracer.enabled = False
    return (result, comm.tracer.take()) if trace else result


# -- the model of a straggler ------------------------------------------------------------------

def test_parse_and_check_stragglers():
    assert parse_stragglers("1:4") == ((1, 4.0),)
    assert parse_stragglers("1:4, 2:1.5") == ((1, 4.0), (2, 1.5))
    for bad in ["3", "x:2", "1:y", "", "1:2:3"]:
        with pytest.raises(ConfigError, match="RANK:FACTOR"):
            parse_stragglers(bad)
    for stragglers, first, words in [
        (((4, 2.0),), 0, "out of range"),
        (((1, 0.5),), 0, "factor"),
        (((1, math.inf),), 0, "factor"),
        (((1, 2.0), (1, 3.0)), 0, "once"),
        (((-1, 2.0),), 0, ">= 0"),
        (((0, 2.0),), 1, "parameter server"),
    ]:
        with pytest.raises(ConfigError, match=words):
            check_stragglers(stragglers, 4, first)


def test_slowdown_stretches_compute_by_the_factor_and_keeps_its_account():
    slow = Slowdown(4.0)
    t0 = time.perf_counter()
    with slow.compute():
        time.sleep(0.01)  # stands for 10 ms of compute
    assert 0.035 <= time.perf_counter() - t0 < 0.2  # 4 x 10 ms, with room for a busy machine
    for _ in slow.pieces(range(200)):
        # tiny pieces: each sleep overshoots, the balance pays it back
        sum(range(200))
    assert slow.owed_s <= 0
    assert slow.slept_s + slow.owed_s == pytest.approx(3 * slow.compute_s, rel=1e-9)
    full_speed = Slowdown(1.0)
    with full_speed.compute():
        time.sleep(0.005)
    assert full_speed.slept_s == 0 and full_speed.compute_s == 0


# -- sync: slower, never different ------------------------------------------------------------

def check_slowdown(events, rank: int, inside: tuple[str, ...]) -> None:
    """``rank`` slept, inside its compute spans, (factor - 1) x its measured compute;
    nobody else slept."""
    naps = [e for e in events if e.kind == "slowdown"]
    assert naps and {e.rank for e in naps} == {rank}
    spans = [e for e in events if e.rank == rank and e.kind in inside]
    assert all(
        any(s.t_start_ns <= e.t_start_ns <= e.t_end_ns <= s.t_end_ns for s in spans) for e in naps
    )
    last = naps[-1].extra  # the running account at the last sleep
    owed = (last["factor"] - 1) * last["compute_s"]
    assert owed <= last["slept_s"] <= owed + 0.05
    assert span_s(events, rank, ("slowdown",)) == pytest.approx(last["slept_s"], rel=1e-6)


def test_sync_straggler_slows_its_rank_and_math_is_unchanged(worlds):
    """Factor 4 on rank 1: only rank 1 sleeps, in its compute, and rank 0's steps wait for it.

    Not a timing ratio between runs: on two busy cores the scheduler moves measured compute
    by milliseconds, more than the compute itself. Lower bounds and the trace's account hold.
    """
    runs = {}
    for factor in (1.0, 4.0):
        stragglers = ((1, factor),) if factor > 1 else ()
        results = worlds(2).run(
            _run, train_sync, HEAVY, SyncConfig("ring", straggler=stragglers), True
        )
        for result, _ in results:
            assert rel(result.params, train_single(HEAVY).params) <= 1e-10
            assert np.array_equal(result.params, results[0][0].params)
        runs[factor] = [e for _, events in results for e in events]
    assert not any(e.kind == "slowdown" for e in runs[1.0])
    check_slowdown(runs[4.0], 1, ("forward", "backward"))
    for step in range(HEAVY.steps):  # the step cannot end on rank 0 before rank 1's slowed forward
        (forward,) = [
            e for e in runs[4.0] if e.rank == 1 and e.kind == "forward" and e.extra["step"] == step
        ]
        (wait,) = [
            e for e in runs[4.0] if e.rank == 0 and e.kind == "wait" and e.extra["step"] == step
        ]
        assert wait.t_end_ns >= forward.t_end_ns


def test_sync_fixed_delay_sets_the_pace_of_every_rank(worlds):
    """Rank 1 sleeps 30 ms per step: no step of rank 0 can take less (noise only adds time)."""
    cfg = dataclasses.replace(HEAVY, steps=5)
    results = worlds(2).run(_run, train_sync, cfg, SyncConfig(delays=(0.0, 0.03)), True)
    events = [e for _, ev in results for e in ev]
    forward = {r: [e.t_end_ns - e.t_start_ns for e in events if e.rank == r and e.kind == "forward"]
               for r in (0, 1)}
    assert min(forward[1]) >= 0.03e9 and np.median(forward[0]) < 0.03e9
    ends = [e.t_end_ns for e in events if e.rank == 0 and e.kind == "optimizer"]
    assert len(ends) == cfg.steps and min(np.diff(ends)) >= 0.03e9
    assert rel(results[0][0].params, train_single(cfg).params) <= 1e-10


@pytest.mark.parametrize("p, straggler, accum", [(3, ((2, 3.0),), 2), (4, ((0, 2.0), (3, 5.0)), 1)])
def test_sync_with_stragglers_equals_single_device(worlds, p, straggler, accum):
    results = worlds(p).run(_run, train_sync, SMALL, SyncConfig("tree", 1e-4, accum, straggler))
    single = train_single(SMALL)
    for r in results:
        assert rel(r.params, single.params) <= 1e-10
        assert r.losses == pytest.approx(single.losses, rel=1e-10)


def test_sync_time_budget_stops_every_rank_at_the_same_step(worlds):
    cfg = dataclasses.replace(SMALL, steps=10**6)
    t0 = time.perf_counter()
    results = worlds(3).run(_run, train_sync, cfg, SyncConfig("ring", time_budget_s=0.3))
    assert time.perf_counter() - t0 < 10
    steps = len(results[0].losses)
    assert steps >= 2 and all(len(r.losses) == steps for r in results)
    single = train_single(dataclasses.replace(SMALL, steps=steps))
    for r in results:
        assert np.array_equal(r.params, results[0].params)
        assert rel(r.params, single.params) <= 1e-10
    at_once = worlds(3).run(_run, train_sync, cfg, SyncConfig(time_budget_s=0))
    assert [len(r.losses) for r in at_once] == [1, 1, 1]  # a spent budget still takes one step


# -- async: the straggler is just a slow worker, and the log still tells all -------------------

def test_async_straggler_computes_slowly_and_replay_stays_exact(worlds):
    cfg, acfg = HEAVY, AsyncConfig(staleness=1, straggler=((2, 4.0),))
    results = [r for r, _ in worlds(3).run(_run, train_async, cfg, acfg, True)]
    server = results[0]
    assert np.array_equal(replay(cfg, acfg, server.log, workers=2), server.params)
    check_slowdown([e for r in results for e in r.events], 2, ("compute",))


def test_async_time_budget_stops_the_workers_and_the_straggler_contributes_less(worlds):
    cfg = dataclasses.replace(HEAVY, steps=10**6)
    acfg = AsyncConfig(staleness=None, straggler=((1, 8.0),), time_budget_s=0.5)
    t0 = time.perf_counter()
    server = worlds(3).run(_run, train_async, cfg, acfg)[0]
    assert time.perf_counter() - t0 < 10
    counts = {w: sum(e.worker == w for e in server.log) for w in (1, 2)}
    assert counts[1] >= 1 and counts[2] > 1.5 * counts[1], counts
    assert np.array_equal(replay(cfg, acfg, server.log, workers=2), server.params)


def test_rank_0_cannot_straggle_in_async(worlds):
    with pytest.raises(ConfigError, match="parameter server"):
        AsyncConfig(straggler=((0, 2.0),)).validate(3)
    with pytest.raises(RankError, match="parameter server"):
        worlds(3).run(_run, train_async, SMALL, AsyncConfig(straggler=((0, 2.0),)))


# -- backup workers ------------------------------------------------------------------------------

def backup(b: int, **kw) -> AsyncConfig:
    return AsyncConfig(staleness=0, aggregate=True, backup_workers=b, **kw)


def test_backup_workers_drop_the_slow_worker_and_replay_exactly(worlds):
    """Worker 1 sleeps 200 ms per compute: every step is made by workers 2 and 3 alone (beside a
    CPU hog, a fast worker can be kept off the cores for tens of milliseconds)."""
    clocks = 5
    cfg, acfg = dataclasses.replace(SMALL, steps=clocks), backup(1, delays=(0.2, 0.0, 0.0))
    server = worlds(4).run(_run, train_async, cfg, acfg)[0]
    assert [e.produced for e in server.log] == [1 + i // 2 for i in range(2 * clocks)]
    assert {e.worker for e in server.log} == {2, 3}
    assert all(e.version == e.clock == e.produced - 1 for e in server.log)
    assert server.dropped and {w for w, _ in server.dropped} == {1}
    assert np.array_equal(replay(cfg, acfg, server.log, workers=3), server.params)
    moved = [dataclasses.replace(server.log[0], worker=1), *server.log[1:]]
    assert not np.array_equal(replay(cfg, acfg, moved, workers=3), server.params)


def test_backup_step_is_the_mean_gradient_of_the_samples_used(worlds):
    """One SGD step from the first two of three gradients (a and b; worker 1 sleeps, so usually
    2 and 3, but the step's rule holds whoever came first):
    params - lr * (g_a + g_b) * global_batch / (n_a + n_b)."""
    cfg = dataclasses.replace(SMALL, steps=1, global_batch=13, optimizer=OptimConfig("sgd", lr=0.1))
    server = worlds(4).run(_run, train_async, cfg, backup(1, delays=(0.05, 0.0, 0.0)))[0]
    first = sorted(e.worker for e in server.log)
    assert len(first) == 2 and {w for w, _ in server.dropped} <= {1, 2, 3} - set(first)
    model, data, params = setup(cfg)
    total, used = np.zeros_like(params), 0
    for w in first:
        grad, idx = np.empty_like(params), worker_batch(cfg, w, 3, 0)
        compute_gradient(model, data, cfg, params, idx, grad)
        total, used = total + grad, used + len(idx)
    assert used == {(1, 2): 9, (1, 3): 9, (2, 3): 8}[tuple(first)]  # shards of 13 over 3: 5, 4, 4
    assert rel(server.params, params - 0.1 * total * (13 / used)) <= 1e-12


def test_zero_backup_workers_is_synchronous_training(worlds):
    cfg = dataclasses.replace(SMALL, global_batch=11)
    server = worlds(4).run(_run, train_async, cfg, backup(0, max_delay_s=0.002))[0]
    plain = worlds(4).run(_run, train_async, cfg, AsyncConfig(staleness=0, aggregate=True))[0]
    assert np.array_equal(server.params, plain.params) and server.dropped == []
    assert rel(server.params, worlds(3).run(_run, train_sync, cfg, SyncConfig())[0].params) <= 1e-10
    assert rel(server.params, train_single(cfg).params) <= 1e-10
    assert np.array_equal(replay(cfg, backup(0), server.log), server.params)


def test_backup_workers_under_a_budget_with_a_straggler(worlds):
    cfg = dataclasses.replace(SMALL, steps=10**6)
    acfg = backup(1, straggler=((3, 4.0),), time_budget_s=0.4)
    server = worlds(4).run(_run, train_async, cfg, acfg)[0]
    assert len(server.log) >= 2 and len(server.log) % 2 == 0  # whole steps only
    assert np.array_equal(replay(cfg, acfg, server.log, workers=3), server.params)


def test_bad_backup_configs_are_config_errors():
    for acfg, words in [(AsyncConfig(staleness=0, backup_workers=1), "aggregate=True"),
                        (backup(3), "backup_workers must be <"), (backup(-1), "backup_workers")]:
        with pytest.raises(ConfigError, match=words):
            acfg.validate(4)
    with pytest.raises(ConfigError, match="workers="):  # the log need not name every worker
        replay(SMALL, backup(1), [])


# -- the command line --------------------------------------------------------------------------

def test_compare_races_sync_async_and_backup_for_a_time_budget(tmp_path, capsys):
    out = tmp_path / "race.json"
    assert main(["compare", "--modes", "sync,async", "--time-budget", "0.3", "--straggler", "1:4",
                 "--json", str(out)]) == 0
    assert "samples_per_s" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["algorithm"]) for r in rows] == [
        ("sync", "ring"), ("backup", "ps backup b=1"),
        ("async", "ps s=0"), ("async", "ps s=2"), ("async", "ps s=inf")]
    for r in rows:
        assert r["straggler"] == "1:4" and r["time_budget_s"] == 0.3 < r["wall_s"] < 5
        assert r["world_size"] == 4 and r["updates"] >= 1 and r["samples_per_s"] > 0
        assert math.isfinite(r["final_loss"])
        assert r["max_abs_diff_vs_single"] < 1e-12 if r["mode"] == "sync" else r["replay_exact"]
    assert rows[1]["dropped"] >= 1


def test_train_with_a_straggler_matches_single_device(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["train", "--world-size", "3", "--steps", "3", "--straggler", "1:3", "--straggler",
                 "2:1.5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["straggler"] == "1:3,2:1.5" and row["max_abs_diff_vs_single"] < 1e-12


@pytest.mark.parametrize("argv, message", [
    (["train", "--straggler", "3"], "bad straggler '3'"),
    (["train", "--straggler", "x:2"], "bad straggler 'x:2'"),
    (["train", "--straggler", "1:0.5"], "factor must be"),
    (["train", "--world-size", "4", "--straggler", "4:2"], "straggler rank 4 is out of range"),
    (["train", "--mode", "async", "--straggler", "0:2"], "parameter server"),
    (["compare", "--modes", "sync,async", "--straggler", "1:2,1:3"], "once"),
    (["train", "--mode", "backup", "--world-size", "3", "--backup-workers", "2"], "backup_workers"),
    (["compare", "--time-budget", "-1"], "time budget"),
])
def test_bad_straggler_and_budget_arguments_one_line_exit_2(cli_here, argv, message):
    proc = cli_here(*argv)  # main in this process (conftest): a world started would fail the test
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_a_bad_straggler_from_the_module_as_run():
    """One case above as a real process: ``python -m`` exits 2 with that one line only."""
    proc = subprocess.run([sys.executable, "-m", "dplab.backends.cli", "train", "--straggler", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad straggler '3'" in lines[0], proc.stderr
