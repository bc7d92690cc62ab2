"""The local backend's native all-reduce is one round: each rank reduces its chunk in every buffer.

Its sums are checked by the conformance suite (``test_collectives.py`` runs ``native`` with buffers
in and out of shared memory); here its shape: one message to each peer per call, nothing staged
for a buffer in shared memory, the staged case copied back whole, bitwise equal on every rank, a
mismatch named before anything is written, and fewer executor lookups per small collective.
"""

from __future__ import annotations

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.reference import collectives
from dplab.reference.collectives import allreduce


def _rounds_and_sums(comm, n, shm, calls):
    """Messages sent and staged bytes per native call, and each call's result."""
    out, sent = [], []
    for it in range(calls):
        buf = comm.empty(n, np.float64) if shm else np.empty(n, np.float64)
        buf[:] = np.arange(n) * (comm.rank + 1) + it
        before, staged = sum(comm.mailboxes.send_seq), comm.bytes_staged
        allreduce(comm, buf, "native")
        sent.append((sum(comm.mailboxes.send_seq) - before, comm.bytes_staged - staged))
        out.append(buf.copy())
    return sent, out


@pytest.mark.parametrize(
    "p,n,shm", [(2, 1000, True), (3, 7, True), (4, 2, False), (3, 1001, False)]
)
def test_native_is_one_message_per_peer_and_the_exact_sum(p, n, shm):
    """direct (the native before) sent 2 (p-1) messages a call; the one-shot sends p - 1, stages
    nothing for a buffer in shared memory and one copy of it otherwise, and every rank gets the sum,
    also where n < p leaves ranks without a chunk."""
    calls = 3
    for sent, out in launch(_rounds_and_sums, p, args=(n, shm, calls), timeout=30):
        assert sent == [(p - 1, 0 if shm else 8 * n)] * calls
        for it, got in enumerate(out):
            want = np.arange(n) * sum(range(1, p + 1)) + p * it
            assert np.array_equal(got, want)


def _floats(comm, n):
    rng = np.random.default_rng(comm.rank)
    buf = comm.empty(n, np.float32)
    buf[:] = rng.standard_normal(n).astype(np.float32) * 10.0 ** rng.integers(-6, 6, n)
    mine = buf.copy()
    allreduce(comm, buf, "native")
    return mine, buf.copy()


def test_native_sums_agree_bitwise_and_add_in_owner_order():
    """Rank d alone adds chunk d, its own part first, then the others upwards: every rank holds the
    same bits, and they are exactly that order's float32 sum."""
    p, n = 3, 3001
    res = launch(_floats, p, args=(n,), timeout=30)
    bounds = collectives.chunk_bounds(n, p)
    for d, (lo, hi) in enumerate(bounds):
        want = res[d][0][lo:hi].copy()
        for q in [*range(d + 1, p), *range(d)]:
            want = want + res[q][0][lo:hi]
        for _, got in res:
            assert np.array_equal(got[lo:hi], want)


def _mismatch(comm, n):
    buf = comm.empty(n, np.int64)
    buf[:] = 5
    try:
        allreduce(comm, buf, "native" if comm.rank == 0 else "ring")
    finally:
        if comm.rank == 0:
            assert (buf == 5).all(), "rank 0 wrote before every peer's message was checked"


def test_a_peer_in_another_collective_is_named_and_nothing_is_written():
    with pytest.raises(RankError) as err:
        launch(_mismatch, 2, args=(64,), timeout=10)
    assert "CollectiveMismatch" in str(err.value) and "allreduce(native)" in str(err.value)


class _Recorder:
    backend, rank, world_size = "local", 0, 2

    def __init__(self) -> None:
        from dplab.reference.trace import Tracer

        self.tracer, self.calls = Tracer(0), []

    def check_buffer(self, buf, call=None) -> None:
        self.calls.append(call)

    def exchange(self, sends, recvs, round=-1, algorithm="") -> None:
        pass


def test_the_engine_looks_a_call_up_once_per_signature(monkeypatch):
    """The schedule, plan and ``Collective`` of a call are built once per (kind, algorithm, p, rank,
    root), then reused: rebuilding the Collective and asking the plan cache cost ~1.5 µs a call."""
    from dplab.backends.fastpath import executor

    asked = []
    plan = executor.schedule_plan
    monkeypatch.setattr(executor, "schedule_plan", lambda *a: asked.append(a) or plan(*a))
    monkeypatch.setattr(executor, "_CALLS", {})
    comm = _Recorder()
    for _ in range(5):
        executor.allreduce(comm, np.zeros(8), "tree")
        executor.broadcast(comm, np.zeros(8), root=1)
    assert asked == [("allreduce", "tree", 2, 0, 0), ("broadcast", "tree", 2, 0, 1)]
    assert comm.calls[0] is comm.calls[2] and str(comm.calls[1]) == "broadcast(tree, root=1)"


def _reused_beside_fresh(comm, n, calls):
    """Rank 1 passes one buffer every call, the others a new one: in rank 0 rank 1's segment is a
    view-cache hit each time and sinks to the bottom of the peer LRU, so mapping rank 2's next
    segment evicts it while the one-shot still holds its view (this was a SIGSEGV: the eviction
    unmapped it under the view)."""
    old = comm.empty(n, np.float64)
    keep = []
    for _ in range(calls):
        buf = old if comm.rank == 1 else comm.empty(n, np.float64)
        keep.append(buf)
        buf[:] = comm.rank + 1
        comm.native_allreduce(buf)
        assert (buf == comm.world_size * (comm.world_size + 1) // 2).all()
    return len(comm.memory._peers)


def test_a_peer_segment_evicted_while_its_view_is_held_stays_readable():
    from dplab.backends.local.memory import PEER_CACHE

    assert launch(_reused_beside_fresh, 3, args=(4096, PEER_CACHE + 4), timeout=60)[0] == PEER_CACHE


def _freed_under_a_view(comm, n):
    """An array from ``comm.empty`` dies while a slice of it lives: its segment is freed and
    unlinked, and the slice still reads and sends (staged: its segment is gone from the ranges)."""
    whole = comm.empty(n, np.float64)
    part = whole[1:]
    part[:] = comm.rank + 1
    del whole
    import gc

    gc.collect()
    comm.native_allreduce(part)
    return float(part.sum())


def test_a_slice_outlives_its_freed_segment():
    p, n = 3, 1 << 14
    assert launch(_freed_under_a_view, p, args=(n,), timeout=30) == [6.0 * (n - 1)] * p
