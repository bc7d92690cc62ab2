"""Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather, and its fold.

The all-reduce, and the reduce-scatter and all-gather that ZeRO and FSDP call (rank r must end
holding chunk r of ``chunk_bounds(n, p)``), for p = 1..64 through the simulator; one message per
peer and round (consecutive chunks coalesce), so the cost model prices lg p alphas per phase; every
backend; and training (``train_sync``, ZeRO stages 0-3) equal to one device.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
from test_ref_zero_traffic import CFG as TRAFFIC
from test_ref_zero_traffic import _sent, schedules_say
from tiers import engines

from dplab.reference import collectives
from dplab.reference.algorithms import SCATTER, allreduce_schedule, recursive_doubling
from dplab.reference.costmodel import cost
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.schedule import Schedule, chunk_bounds, messages_of
from dplab.reference.simulate import is_allreduce, simulate
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.traffic import sent_closed_form
from dplab.reference.zero.train import train_zero

WORLDS = range(1, 65)
VALUED = (*range(1, 17), 31, 33, 64)  # provenance for every p; values (slower) for these


def lg(p: int) -> int:
    return p.bit_length() - 1  # floor(lg p)


def folded(p: int) -> bool:
    return p & (p - 1) != 0


@cache
def built(p: int) -> tuple[Schedule, Schedule, Schedule]:
    """(all-reduce, reduce-scatter, all-gather) for p ranks, built once for the whole module."""
    return (allreduce_schedule("rabenseifner", p), *(f(p) for f in SCATTER["rabenseifner"]))


def random_buffers(p: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng([p, n])
    return [rng.integers(-10**12, 10**12, size=n) for _ in range(p)]


# -- the schedules, through the simulator ----------------------------------------------------------

def test_allreduce_counts_every_contribution_once_for_p_1_to_64():
    for p in WORLDS:
        s = built(p)[0]
        assert is_allreduce(simulate(s)), p
        assert s.num_chunks == 1 << lg(p)  # p' even chunks: MPICH's halves
        for n in (1, 3 * p + 2) if p in VALUED else ():
            bufs = random_buffers(p, n)
            total = np.sum(bufs, axis=0, dtype=np.int64)
            assert all(np.array_equal(b, total) for b in simulate(s, bufs).buffers), (p, n)


def test_reduce_scatter_leaves_chunk_r_on_rank_r_for_p_1_to_64():
    for p in WORLDS:
        rs = built(p)[1]
        assert rs.num_chunks == p
        final = simulate(rs).holdings[-1]
        for r in range(p):
            np.testing.assert_array_equal(final[r, r], np.ones(p, np.int64), err_msg=f"p={p} rank "
                                                                                     f"{r}")
        for n in (p - 1, 2 * p + 3) if p in VALUED else ():
            bufs = random_buffers(p, n)
            total, out = np.sum(bufs, axis=0, dtype=np.int64), simulate(rs, bufs).buffers
            for r, (a, b) in enumerate(chunk_bounds(n, p)):
                np.testing.assert_array_equal(out[r][a:b], total[a:b], err_msg=f"p={p} n={n} rank "
                                                                               f"{r}")


def test_allgather_gives_everyone_every_owners_chunk_for_p_1_to_64():
    for p in WORLDS:
        final = simulate(built(p)[2]).holdings[-1]
        eye = np.eye(p, dtype=np.int64)
        assert all(np.array_equal(final[r, c], eye[c]) for r in range(p) for c in range(p)), p


def test_rounds_are_2_lg_p_plus_two_for_the_fold():
    for p in WORLDS:
        m, f = lg(p), folded(p)
        ar, rs, ag = built(p)
        assert len(ar.rounds) == 2 * m + 2 * f, p
        assert len(rs.rounds) == len(ag.rounds) == m + 2 * f, p


def test_each_rank_sends_one_message_per_round():
    """A round's chunks to one peer are consecutive, so they travel as one message; only the
    all-gather's last fold round sends two (the chunks before and after the partner's own)."""
    for p in VALUED:
        for s in built(p):
            for rank in range(p):
                plan = messages_of(s, rank)
                for k, (sends, recvs) in enumerate(plan):
                    limit = 2 if s.name.endswith("allgather") and k == len(plan) - 1 else 1
                    assert len(sends) <= limit and len(recvs) <= limit, (s.name, p, rank, k)
                    # zero copy: never sends what it receives into
                    assert not any(m.snapshot for m in sends)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16, 64, 3, 5, 6, 7, 12, 33])
def test_cost_is_the_closed_form(p):
    """p = 2^m: 2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma (the ring's bytes, the tree's
    latency). Otherwise p' = 2^floor(lg p) ranks run that, and the fold adds a whole-buffer reduce
    and copy: (2 lg p' + 2) alpha + (2 (p'-1)/p' + 2) n beta + ((p'-1)/p' + 1) n gamma."""
    q = 1 << lg(p)
    n, alpha, beta, gamma = 64 * q * 3, 1e-5, 1e-9, 1e-10
    got = cost(built(p)[0], n, alpha, beta, gamma)
    f = folded(p)
    want = ((2 * lg(p) + 2 * f) * alpha + (2 * (q - 1) / q + 2 * f) * n * beta
            + ((q - 1) / q + f) * n * gamma)
    assert math.isclose(got.time, want, rel_tol=1e-12), (got, want)
    # an even rank of the fold: + the copy back
    assert got.bytes_sent_max == 2 * (q - 1) * n // q + f * n
    if not f:  # the ring's bytes in 2 lg p rounds instead of 2 (p - 1)
        ring = cost(allreduce_schedule("ring", p), n, alpha, beta, gamma)
        assert got.bytes_sent_max == ring.bytes_sent_max and got.rounds == 2 * lg(p)


def test_it_beats_recursive_doubling_on_bytes_and_the_ring_on_rounds():
    for p in (8, 64):
        n = 1 << 20
        rab, rd, ring = (cost(allreduce_schedule(a, p), n, 0.0, 1.0, 0.0)
                         for a in ("rabenseifner", "recursive_doubling", "ring"))
        assert rab.time == ring.time == 2 * (p - 1) / p * n and rd.time == lg(p) * n
        assert cost(allreduce_schedule("rabenseifner", p), n, 1.0, 0.0, 0.0).time == 2 * lg(p)
        assert cost(allreduce_schedule("ring", p), n, 1.0, 0.0, 0.0).time == 2 * (p - 1)


# -- every backend ---------------------------------------------------------------------------

def job(comm, kind, n, dtype, how):
    buf = comm.empty(n, dtype) if how == "shm" else np.empty(n, dtype)
    buf[...] = (np.arange(n) % 1000 - 500) * (comm.rank + 1)
    a, b = chunk_bounds(n, comm.world_size)[comm.rank]
    if kind == "allgather":
        keep = buf[a:b].copy()
        buf[...] = -1
        buf[a:b] = keep
        return np.array(collectives.allgather(comm, buf, "rabenseifner"), copy=True)
    if kind == "reduce_scatter":
        mine = collectives.reduce_scatter(comm, buf, "rabenseifner")
        return np.shares_memory(mine, buf) or mine.size == 0, np.array(mine, copy=True)
    return np.array(collectives.allreduce(comm, buf, "rabenseifner"), copy=True)


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4, 5, 6, 8]), indirect=["backend"])
def test_rabenseifner_collectives_on_every_backend(worlds, backend, p):
    for n, dtype, how in ((0, "float64", "shm"), (2, "int32", "numpy"), (13, "float32", "shm"),
                          (100_003, "int64", "numpy"), (4099, "float64", "shm")):
        base = (np.arange(n) % 1000 - 500).astype(dtype)
        total = (base * (p * (p + 1) // 2)).astype(dtype)
        label = f"{backend} p={p} n={n} {how}"
        for rank, out in enumerate(worlds(p, backend).run(job, "allreduce", n, dtype, how)):
            np.testing.assert_array_equal(out, total, err_msg=f"allreduce {label} rank {rank}")
        for rank, (view, mine) in enumerate(
            worlds(p, backend).run(job, "reduce_scatter", n, dtype, how)
        ):
            a, b = chunk_bounds(n, p)[rank]
            assert view
            np.testing.assert_array_equal(mine, total[a:b], err_msg=f"reduce_scatter {label} rank "
                                                                    f"{rank}")
        want = np.concatenate([base[a:b] * (r + 1) for r, (a, b) in enumerate(chunk_bounds(n, p))])
        for rank, out in enumerate(worlds(p, backend).run(job, "allgather", n, dtype, how)):
            np.testing.assert_array_equal(out, want.astype(dtype), err_msg=f"allgather {label} "
                                                                           f"rank {rank}")


# -- training --------------------------------------------------------------------------------

CFG = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                  global_batch=11, steps=3, seed=3, optimizer=OptimConfig("adam", lr=0.01))


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _sync(comm, cfg, sync):
    return train_sync(comm, cfg, sync)


def _zero(comm, cfg, zero):
    return train_zero(comm, cfg, zero)


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3, 5]), indirect=["backend"])
def test_train_sync_with_rabenseifner_equals_train_single(worlds, backend, p):
    ref = train_single(CFG)
    for cap in (1e-6, 1e3):
        results = worlds(p, backend).run(_sync, CFG, SyncConfig("rabenseifner", cap, 2))
        assert rel(results[0].params, ref.params) <= 1e-10
        assert all(np.array_equal(r.params, results[0].params) for r in results)


@pytest.mark.parametrize("p", [3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_with_rabenseifner_equals_train_single(worlds, backend, stage, p):
    ref = train_single(CFG)
    results = worlds(p, backend).run(_zero, CFG, ZeroConfig(stage=stage, algorithm="rabenseifner",
                                                            accum_steps=2))
    assert rel(results[0].params, ref.params) <= 1e-10
    assert all(np.array_equal(r.params, results[0].params) for r in results)
    assert sum(r.shard_elems for r in results) == ref.params.size


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_sends_per_step_what_rabenseifners_schedules_say(worlds, stage, p):
    """Counted from the trace, whose messages carry several chunks (``traffic.collective_sent``
    reads their spans); a power of two sends the paper's 2 or 3 (p-1)/p Psi on average, others no
    less (at p = 3 the all-reduce's fold costs exactly the ring's bytes, the reduce-scatter's
    more)."""
    model = MLP(TRAFFIC.model)
    sizes = [(s := model.layer_slice(layer)).stop - s.start for layer in range(model.num_layers)]
    per_rank = worlds(p).run(_sent, TRAFFIC, ZeroConfig(stage=stage, algorithm="rabenseifner"))
    for rank, steps in enumerate(per_rank):
        assert (
            steps == [8 * schedules_say(stage, "rabenseifner", p, rank, sizes, 1)] * TRAFFIC.steps
        ), rank
    mean, paper = sum(s[0] for s in per_rank) / p, 8 * sent_closed_form(stage, model.num_params, p)
    assert mean == pytest.approx(paper, rel=1e-12) if not folded(p) else mean >= paper * (1 - 1e-12)


def test_recursive_doubling_and_rabenseifner_share_the_fold():
    assert recursive_doubling.fold(6) == (4, 2, [0, 2, 4, 5])
    assert recursive_doubling.fold(8) == (8, 0, list(range(8)))
