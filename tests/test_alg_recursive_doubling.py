"""Recursive doubling: the schedule, the exchange's snapshot, every backend, and training.

It is the one schedule whose ranks send each other the same chunk in the same round, each adding
the other's into its own. A send carries the chunk as the round found it, so the executor sends a
snapshot of exactly those chunks (``schedule.messages_of``); a zero-copy transport (the local
backend reads the peer's shared memory; MPI's isend reads the buffer while the receive adds) would
otherwise hand the partner a half-updated chunk. The schedules that do not exchange stay zero-copy.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from tiers import engines

from dplab.reference import collectives
from dplab.reference.algorithms import ROOTED, SCATTER, allreduce_schedule, recursive_doubling
from dplab.reference.communicator import Communicator
from dplab.reference.costmodel import cost
from dplab.reference.schedule import messages_of
from dplab.reference.simulate import initial_holdings, is_allreduce, simulate
from dplab.reference.trace import Tracer
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

# they never send what they receive into
ZERO_COPY = ("ring", "tree", "naive", "direct", "rabenseifner")


def lg(p: int) -> int:
    return p.bit_length() - 1  # floor(lg p)


# -- the schedule ----------------------------------------------------------------------------

def test_recursive_doubling_counts_every_contribution_once_for_p_1_to_64():
    for p in range(1, 65):
        s = allreduce_schedule("recursive_doubling", p)
        sim = simulate(s)
        assert s.num_chunks == 1 and is_allreduce(sim), p
        np.testing.assert_array_equal(sim.holdings[0], initial_holdings(p, 1))
        rng = np.random.default_rng(p)
        for n in (0, 1, 3, 17):
            bufs = [rng.integers(-10**12, 10**12, size=n) for _ in range(p)]
            total = np.sum(bufs, axis=0, dtype=np.int64)
            assert all(np.array_equal(b, total) for b in simulate(s, bufs).buffers), (p, n)


def test_rounds_are_lg_p_plus_two_for_the_fold_and_pair_every_rank_with_one_partner():
    for p in range(1, 65):
        s = recursive_doubling.allreduce(p)
        folded = p & (p - 1) != 0
        assert len(s.rounds) == lg(p) + 2 * folded, p
        exchanges = s.rounds[1:-1] if folded else s.rounds
        pof2, rem, real = recursive_doubling.fold(p)
        for k, rnd in enumerate(exchanges):
            pairs = {(t.src, t.dst) for t in rnd}
            assert all((b, a) in pairs for a, b in pairs) and len(pairs) == len(rnd) == pof2, (p, k)
            assert sorted(t.src for t in rnd) == sorted(real)  # each taking part once, both ways
            assert all(
                abs(t.src - t.dst) == abs(real[real.index(t.src) ^ (1 << k)] - t.src) for t in rnd
            )
        if folded:
            first, last = s.rounds[0], s.rounds[-1]
            assert [(t.src, t.dst, t.op) for t in first] == [
                (2 * i + 1, 2 * i, "reduce") for i in range(rem)
            ]
            assert [(t.src, t.dst, t.op) for t in last] == [
                (2 * i, 2 * i + 1, "copy") for i in range(rem)
            ]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 33, 64])
def test_cost_is_the_closed_form(p):
    """(lg p) (alpha + n beta + n gamma) for p = 2^m; the fold adds a reducing and a copying round:
    (lg p + 2) alpha + (lg p + 2) n beta + (lg p + 1) n gamma (lg p rounded down)."""
    n, alpha, beta, gamma = 3 * 1024, 1e-5, 1e-9, 1e-10
    got = cost(recursive_doubling.allreduce(p), n, alpha, beta, gamma)
    m, fold = lg(p), p & (p - 1) != 0
    want = (m + 2 * fold) * (alpha + n * beta) + (m + fold) * n * gamma
    assert math.isclose(got.time, want, rel_tol=1e-12), (got, want)
    assert got.rounds == m + 2 * fold
    # the even ranks of the fold send most
    assert got.bytes_sent_max == (0 if p == 1 else n * (m + fold))


def test_the_exchange_is_the_only_place_a_snapshot_is_sent():
    for p in range(1, 17):
        s = recursive_doubling.allreduce(p)
        folded = p & (p - 1) != 0
        for rank in range(p):
            for k, (sends, recvs) in enumerate(messages_of(s, rank)):
                exchange = not (folded and k in (0, len(s.rounds) - 1))
                assert all(m.snapshot == exchange for m in sends), (p, rank, k)
                assert all(not m.snapshot for m in recvs)
    for p in range(1, 17):  # ring and the others send straight out of the buffer: zero copy
        schedules = [allreduce_schedule(a, p) for a in ZERO_COPY]
        schedules += [f(p) for a, pair in SCATTER.items() if a in ZERO_COPY for f in pair]
        schedules += [f(p, p - 1) for a, pair in ROOTED.items() if a in ZERO_COPY for f in pair]
        for s in schedules:
            assert not any(
                m.snapshot for r in range(p) for sends, _ in messages_of(s, r) for m in sends
            ), s


# -- the executor sends the chunk as the round found it --------------------------------------------

class ZeroCopyPair(Communicator):
    """Two ranks in threads over the worst zero-copy transport: a receive reads the sender's memory
    only when it is applied, and rank 0 applies its receives before rank 1 does. A send straight out
    of the buffer would hand rank 1 rank 0's already-summed chunk (rank 0's part counted twice)."""

    def __init__(self, rank: int, box: dict, gate: threading.Barrier) -> None:
        self.rank, self.world_size, self.timeout, self.tracer = rank, 2, 10.0, Tracer(rank)
        self.box, self.gate = box, gate

    def exchange(self, sends, recvs, round=-1, algorithm=""):
        for s in sends:
            self.box[(self.rank, s.peer)] = s.buf  # the memory itself, not a copy
        self.gate.wait(self.timeout)
        for turn in range(2):
            if turn == self.rank:
                for r in recvs:
                    src = self.box.pop((r.peer, self.rank))
                    if r.reduce:
                        np.add(r.buf, src, out=r.buf)
                    else:
                        r.buf[...] = src
            self.gate.wait(self.timeout)

    def isend(self, buf, dst, tag=0):
        raise NotImplementedError

    def irecv(self, buf, src=-1, tag=0):
        raise NotImplementedError

    def native_allreduce(self, buf, op="sum", check=True):
        raise NotImplementedError

    def close(self):
        pass


def test_an_exchange_sends_the_value_from_the_start_of_the_round_on_a_zero_copy_transport():
    box, gate = {}, threading.Barrier(2)
    comms = [ZeroCopyPair(r, box, gate) for r in range(2)]
    # 0 1 2 3 4 and 0 10 20 30 40
    bufs = [np.arange(5, dtype=np.float64) * 10 ** r for r in range(2)]
    errors = []

    def rank(r: int) -> None:
        try:
            collectives.allreduce(comms[r], bufs[r], algorithm="recursive_doubling")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            gate.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for r in range(2):  # without the snapshot rank 1 ends with 0 21 42 63 84
        np.testing.assert_array_equal(bufs[r], [0, 11, 22, 33, 44], err_msg=f"rank {r}")


# -- every backend ---------------------------------------------------------------------------

def job_allreduce(comm, algorithm, n, dtype, how):
    """This rank's sum, and the bytes the local backend copied to send it (its ``bytes_staged``)."""
    buf = comm.empty(n, dtype) if how == "shm" else np.empty(n, dtype)
    buf[...] = (np.arange(n) % 1000 - 500) * (comm.rank + 1)
    staged = getattr(comm, "bytes_staged", 0)
    out = collectives.allreduce(comm, buf, algorithm=algorithm)
    return out is buf, np.array(buf, copy=True), getattr(comm, "bytes_staged", 0) - staged


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4, 5, 8]), indirect=["backend"])
def test_recursive_doubling_sums_exactly_on_every_backend(worlds, backend, p):
    for n, dtype, how in ((0, "float64", "shm"), (1, "int32", "numpy"), (7, "float32", "shm"),
                          (100_003, "int64", "shm"), (4099, "float64", "numpy")):
        results = worlds(p, backend).run(job_allreduce, "recursive_doubling", n, dtype, how)
        want = ((np.arange(n) % 1000 - 500) * (p * (p + 1) // 2)).astype(dtype)
        for rank, (same, out, _) in enumerate(results):
            assert same and out.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(out, want, err_msg=f"{backend} p={p} n={n} {how} rank "
                                                             f"{rank}")


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_only_the_exchanges_copy_and_ring_stays_zero_copy_on_shared_memory(worlds, p):
    """Local backend, buffers in shared memory: ring and Rabenseifner copy nothing; recursive
    doubling copies its whole buffer once per exchange it takes part in (lg p' of them), no more."""
    n = 1000
    pof2, _, real = recursive_doubling.fold(p)
    for algorithm in ("ring", "rabenseifner", "recursive_doubling"):
        results = worlds(p).run(job_allreduce, algorithm, n, "float64", "shm")
        for rank, (_, _, staged) in enumerate(results):
            exchanges = lg(pof2) if algorithm == "recursive_doubling" and rank in real else 0
            assert staged == exchanges * n * 8, (algorithm, p, rank, staged)


def job_tensor(comm, n, dtype):
    """A torch tensor through the exchange: its snapshot is a tensor too (``buf.new_empty``)."""
    import torch

    t = (torch.arange(n) % 16 * (comm.rank + 1)).to(getattr(torch, dtype))
    out = collectives.allreduce(comm, t, algorithm="recursive_doubling")
    return out is t, t.double().numpy()


@pytest.mark.torch
@pytest.mark.parametrize("p", [2, 3])
def test_torch_tensors_take_the_snapshot_too(worlds, p):
    from dplab.backends.launch.world import BackendUnavailable, check_backend

    try:
        check_backend("torch")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    for dtype in ("float64", "bfloat16"):  # small integers: exact in bfloat16 too
        for rank, (same, out) in enumerate(worlds(p, "torch").run(job_tensor, 1000, dtype)):
            assert same
            want = np.arange(1000) % 16 * (p * (p + 1) // 2)
            np.testing.assert_array_equal(out, want, err_msg=f"{dtype} rank {rank}")


# -- training --------------------------------------------------------------------------------

def _train(comm, cfg, sync):
    return train_sync(comm, cfg, sync)


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3, 5]), indirect=["backend"])
def test_train_sync_with_recursive_doubling_equals_train_single(worlds, backend, p):
    from dplab.reference.model import MLPConfig
    from dplab.reference.optim import OptimConfig

    cfg = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=50,
                      global_batch=11, steps=3, seed=3, optimizer=OptimConfig("adam", lr=0.01))
    ref = train_single(cfg)
    for cap in (1e-6, 1e3):  # a bucket per parameter, and one bucket
        results = worlds(p, backend).run(_train, cfg, SyncConfig("recursive_doubling", cap))
        err = np.max(np.abs(results[0].params - ref.params)) / max(1.0, np.max(np.abs(ref.params)))
        assert err <= 1e-10, err
        assert all(np.array_equal(r.params, results[0].params) for r in results)
