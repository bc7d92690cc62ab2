"""The parameter server: replayable bit for bit, never staler than its bound, sync when
lock-stepped.

Whatever the interleaving (random sleeps before each compute make runs differ), the
server's log must replay on one device to the very same float64 bits; every applied
gradient must come from a pull the SSP gate allowed (the slowest worker had finished at
least ``clock - staleness`` clocks); a straggler must actually push a fast worker to that
bound; and lock-step aggregation must equal synchronous data parallelism.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import train_configs
from tiers import engine_spans

from dplab.backends.launch.world import RankError
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.ps.replay import replay
from dplab.reference.ps.trainer import AsyncConfig, LogEntry, train_async
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

EXAMPLES = settings.default.max_examples  # the profile's base count (DPLAB_EXAMPLES, default 50)
BASE = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                   global_batch=11, steps=4, seed=3)


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(
        np.max(np.abs(a - b), initial=0.0) / max(1.0, float(np.max(np.abs(b), initial=0.0)))
    )


# -- rank functions (module level: World.run pickles them) -----------------------------------

def _train_async(comm, cfg, acfg):
    return train_async(comm, cfg, acfg)


def _train_async_traced(comm, cfg, acfg):
    comm.tracer.enabled = True
    try:
        return train_async(comm, cfg, acfg)
    finally:
        comm.tracer.enabled = False
        comm.tracer.take()


def _train_sync(comm, cfg):
    return train_sync(comm, cfg, SyncConfig("ring"))


def _rank1_fails_first(comm, cfg, acfg):
    if comm.rank == 1:
        raise RuntimeError("worker 1 broke before its first pull")
    return train_async(comm, cfg, acfg)


# -- strategies ------------------------------------------------------------------------------

@st.composite
def async_configs(draw, workers: int) -> AsyncConfig:
    staleness = draw(st.sampled_from([0, 1, 2, 3, None]))
    slow = draw(st.lists(st.sampled_from([0.0, 0.0, 0.002]), min_size=workers, max_size=workers))
    return AsyncConfig(staleness=staleness, aggregate=staleness == 0 and draw(st.booleans()),
                       delays=tuple(slow), max_delay_s=draw(st.sampled_from([0.0, 0.001, 0.003])),
                       delay_seed=draw(st.integers(0, 2**16)))


@st.composite
def runs(draw, lo: int = 2, hi: int = 6):
    """(world_size, TrainConfig, AsyncConfig): 1..5 workers beside the server (p in lo..hi)."""
    p = draw(st.integers(lo, hi))
    cfg = draw(
        train_configs(draw(st.sampled_from(["float64", "float64", "float32"])), steps=(0, 5))
    )
    return p, cfg, draw(async_configs(p - 1))


# -- what every log must satisfy --------------------------------------------------------------

def check_log(log: list[LogEntry], workers: int, clocks: int, acfg: AsyncConfig) -> None:
    assert len(log) == workers * clocks
    group = workers if acfg.aggregate else 1
    assert [e.produced for e in log] == [1 + i // group for i in range(len(log))]
    for w in range(1, workers + 1):
        mine = [e for e in log if e.worker == w]
        assert [e.clock for e in mine] == list(range(clocks)), f"worker {w} pushed out of order"
        if not acfg.aggregate:  # a worker's next pull sees its own previous push
            assert all(a.produced <= b.version for a, b in zip(mine, mine[1:]))
    for e in log:
        assert 0 <= e.version < e.produced and 0 <= e.slowest_done <= e.clock
        if acfg.staleness is not None:
            assert e.clock - e.slowest_done <= acfg.staleness, (
                f"{e} broke the bound {acfg.staleness}"
            )
        if acfg.staleness == 0:  # lock-step: only this clock's other pushes can land in between
            assert e.delay <= workers - 1
        if acfg.aggregate:
            assert e.version == e.clock and e.delay == 0


# -- replay: the log is the whole story -------------------------------------------------------

# The server, gate and replay are the same code on every backend; what an engine adds is its
# any-source receive and its pickling of jobs, which a quarter of the examples still exercise.
# local: p in 2..6, every example; other engines: p = 3, a quarter (all: slow; tiers.py)
@pytest.mark.parametrize("backend, sweep", engine_spans(2, 6), indirect=["backend"])
def test_replaying_the_log_reproduces_the_server_bit_for_bit(worlds, backend, sweep):
    @settings(max_examples=sweep.examples(3 * EXAMPLES), deadline=None)
    @given(run=runs(sweep.lo, sweep.hi))
    def prop(run):
        p, cfg, acfg = run
        results = worlds(p, backend).run(_train_async, cfg, acfg)
        server = results[0]
        check_log(server.log, p - 1, cfg.steps, acfg)
        assert server.params.dtype == np.dtype(cfg.dtype)
        again = replay(cfg, acfg, server.log, workers=p - 1)
        assert again.dtype == server.params.dtype and np.array_equal(again, server.params)
        if cfg.steps == 0:
            assert np.array_equal(server.params, setup(cfg)[2])

    prop()


def test_training_moves_the_parameters_and_replay_notices_a_changed_log(worlds):
    """Guard against a vacuous pass: the runs learn, and the replay is sensitive to the log."""
    cfg, acfg = dataclasses.replace(BASE, steps=5), AsyncConfig(staleness=2, max_delay_s=0.002)
    server = worlds(4).run(_train_async, cfg, acfg)[0]
    assert rel(server.params, setup(cfg)[2]) > 1e-3
    assert np.array_equal(replay(cfg, acfg, server.log), server.params)
    i = next(i for i, e in enumerate(server.log) if e.produced >= 2)
    moved = list(server.log)
    moved[i] = dataclasses.replace(moved[i], version=(moved[i].version + 1) % moved[i].produced)
    assert not np.array_equal(replay(cfg, acfg, moved), server.params)


# -- the SSP gate: respected, and actually reached ---------------------------------------------

@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_a_straggler_pushes_fast_workers_exactly_to_the_bound(worlds, staleness):
    """Worker 1 sleeps 40 ms per clock, workers 2 and 3 none: they run ahead until the gate stops
    them."""
    clocks = staleness + 3
    cfg, acfg = dataclasses.replace(BASE, steps=clocks), AsyncConfig(staleness, delays=(0.04, 0, 0))
    server = worlds(4).run(_train_async, cfg, acfg)[0]
    check_log(server.log, 3, clocks, acfg)
    gaps = [e.clock - e.slowest_done for e in server.log]
    assert max(gaps) == staleness, f"clock - slowest_done reached {max(gaps)}, bound {staleness}"
    fast = [e for e in server.log if e.worker > 1]
    assert sum(e.clock - e.slowest_done == staleness for e in fast) >= 2
    assert np.array_equal(replay(cfg, acfg, server.log), server.params)


def test_without_a_bound_the_fast_workers_do_not_wait(worlds):
    cfg, acfg = dataclasses.replace(BASE, steps=6), AsyncConfig(None, delays=(0.04, 0, 0))
    server = worlds(4).run(_train_async, cfg, acfg)[0]
    check_log(server.log, 3, 6, acfg)
    assert max(e.clock - e.slowest_done for e in server.log) >= 4  # beyond every bound tested above
    assert max(e.delay for e in server.log) >= 4
    assert np.array_equal(replay(cfg, acfg, server.log), server.params)


# -- lock-step aggregation is synchronous data parallelism -------------------------------------

@settings(max_examples=EXAMPLES, deadline=None)
@given(
    workers=st.integers(1, 5),
    cfg=train_configs(steps=(0, 5)),
    max_delay_s=st.sampled_from([0.0, 0.002]),
)
def test_lockstep_aggregation_equals_train_sync_and_train_single(worlds, workers, cfg, max_delay_s):
    acfg = AsyncConfig(staleness=0, aggregate=True, max_delay_s=max_delay_s)
    server = worlds(workers + 1).run(_train_async, cfg, acfg)[0]
    sync = worlds(workers).run(_train_sync, cfg)[0]
    single = train_single(cfg)
    assert rel(server.params, sync.params) <= 1e-10
    assert rel(server.params, single.params) <= 1e-10
    assert np.array_equal(replay(cfg, acfg, server.log), server.params)


def test_lockstep_aggregation_float32_within_1e_5(worlds):
    cfg = dataclasses.replace(BASE, dtype="float32", optimizer=OptimConfig("adam", lr=0.01))
    server = worlds(4).run(_train_async, cfg, AsyncConfig(0, aggregate=True))[0]
    assert server.params.dtype == np.float32
    assert rel(server.params, train_single(cfg).params) <= 1e-5


# -- traces: a timeline and a delay histogram --------------------------------------------------

def test_trace_has_worker_spans_and_server_applies(worlds):
    cfg, acfg = dataclasses.replace(BASE, steps=3), AsyncConfig(staleness=1, max_delay_s=0.002)
    results = worlds(3).run(_train_async_traced, cfg, acfg)
    server = results[0]
    applies = [e for e in server.events if e.kind == "apply"]
    assert [(e.extra["worker"], e.extra["clock"], e.extra["delay"]) for e in applies] == [
        (e.worker, e.clock, e.delay) for e in server.log]
    assert len([e for e in server.events if e.kind == "reply"]) == 2 * cfg.steps
    for rank, r in enumerate(results[1:], start=1):
        assert r.log == [] and all(e.rank == rank for e in r.events)
        for kind in ("wait", "pull", "compute", "push"):
            spans = [e for e in r.events if e.kind == kind]
            assert [e.extra["clock"] for e in spans] == list(range(cfg.steps)), kind
            mine = [e for e in server.log if e.worker == rank]
            assert [e.extra["version"] for e in spans] == [e.version for e in mine], kind
            assert all(e.t_start_ns <= e.t_end_ns for e in spans)
    assert worlds(3).run(_train_async, cfg, acfg)[0].events == []  # tracing off: no events


# -- bad input, and failures that must not hang -----------------------------------------------

@pytest.mark.parametrize("acfg, words", [
    (AsyncConfig(staleness=1, aggregate=True), "staleness=0"),
    (AsyncConfig(staleness=None, aggregate=True), "staleness=0"),
    (AsyncConfig(clocks=-1), "clocks"),
    (AsyncConfig(staleness=-1), "staleness"),
    (AsyncConfig(max_delay_s=-0.1), "max_delay_s"),
    (AsyncConfig(delays=(0.1, -1.0)), "delays"),
])
def test_bad_async_config_is_a_config_error(worlds, acfg, words):
    with pytest.raises(ConfigError, match=words):
        acfg.validate()
    with pytest.raises(RankError, match="ConfigError") as info:
        worlds(3).run(_train_async, BASE, acfg)
    assert words in str(info.value)


def test_one_rank_is_a_config_error(worlds):
    with pytest.raises(RankError, match="world_size >= 2"):
        worlds(1).run(_train_async, BASE, AsyncConfig())


def test_delays_must_name_every_worker(worlds):
    with pytest.raises(RankError, match="one entry per worker"):
        worlds(4).run(_train_async, BASE, AsyncConfig(delays=(0.0, 0.0)))


def test_a_failing_worker_surfaces_as_rank_error_without_hanging(worlds):
    world = worlds(3)  # started before the clock: under load a start alone can take seconds
    start = time.monotonic()
    with pytest.raises(RankError, match="worker 1 broke") as info:
        world.run(_rank1_fails_first, BASE, AsyncConfig(staleness=0))
    assert info.value.rank == 1 and time.monotonic() - start < world.timeout
    server = worlds(3).run(_train_async, BASE, AsyncConfig())[0]  # the world restarts and works
    assert len(server.log) == 2 * BASE.steps


def test_clocks_override_steps(worlds):
    server = worlds(3).run(_train_async, BASE, AsyncConfig(staleness=None, clocks=2))[0]
    assert len(server.log) == 2 * 2
    assert np.array_equal(replay(BASE, AsyncConfig(None, clocks=2), server.log), server.params)


def test_replay_calls_each_after_every_update_and_fresh_drops_only_the_staleness():
    """``each`` sees every update; ``fresh=True`` computes each gradient on the current
    parameters."""
    from dplab.reference.ps.protocol import LogEntry
    from dplab.reference.ps.replay import replay
    from dplab.reference.ps.trainer import AsyncConfig
    from dplab.reference.train.single import TrainConfig
    cfg, acfg = TrainConfig(steps=4), AsyncConfig(staleness=None)
    current = [LogEntry(worker=k % 2 + 1, clock=k // 2, version=k, produced=k + 1, slowest_done=0)
               for k in range(6)]
    stale = [
        LogEntry(
            worker=k % 2 + 1, clock=k // 2, version=max(0, k - 3), produced=k + 1, slowest_done=0
        )
        for k in range(6)
    ]
    seen = []
    final = replay(cfg, acfg, stale, 2, each=lambda k, p: seen.append((k, p.copy())))
    assert [k for k, _ in seen] == [1, 2, 3, 4, 5, 6] and np.array_equal(seen[-1][1], final)
    assert np.array_equal(replay(cfg, acfg, current, 2, fresh=True), replay(cfg, acfg, current, 2))
    assert np.array_equal(replay(cfg, acfg, stale, 2, fresh=True), replay(cfg, acfg, current, 2))
    assert not np.array_equal(final, replay(cfg, acfg, current, 2))
