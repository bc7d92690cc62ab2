"""The local backend's fast path, by structure (speed itself is measured by ``dplab bench``).

A waiting rank spins a bounded number of times and then sleeps (two cores: an unbounded spin
starves the peer it waits for); a receive reduces straight out of the peer's memory, in place,
with no temporary; the views into peers' segments are made once per chunk and then kept,
bounded, and dropped with the segment they point into.
"""

from __future__ import annotations

import os
import time
import tracemalloc

import numpy as np
import pytest

from dplab.backends.launch.world import launch
from dplab.backends.local import memory
from dplab.backends.local.mailboxes import Waiter
from dplab.backends.local.shm import Segment
from dplab.reference.collectives import allreduce


def _wait_cpu(comm, delay):
    """Rank 0 sends after ``delay`` seconds; the others each wait for it. Returns the CPU seconds
    a waiting rank spent while it waited."""
    buf = comm.empty(4, np.float64)
    comm.barrier()
    if comm.rank == 0:
        time.sleep(delay)
        for dst in range(1, comm.world_size):
            buf[:] = dst
            comm.send(buf, dst)
        return None
    cpu = time.thread_time()  # this thread's: not the launcher's watch thread, nor anyone else's
    comm.recv(buf, 0)
    assert buf.tolist() == [float(comm.rank)] * 4
    waiter = comm.mailboxes.waiter
    return time.thread_time() - cpu, waiter.spin, waiter.yields


@pytest.mark.parametrize("p", [2, 4])
def test_a_waiting_rank_sleeps_after_a_bounded_spin(p):
    """p=2 spins (a rank per core), p=4 yields (more ranks than cores): both bounded, then sleep.
    Half a second of waiting costs a sleeping rank well under a tenth of a second of CPU."""
    delay = 0.5
    for cpu, spin, yields in launch(_wait_cpu, p, args=(delay,), timeout=20)[1:]:
        assert (
            spin <= 1e-3 and yields <= 1_000 and (spin > 0) == (p <= len(os.sched_getaffinity(0)))
        )
        assert cpu < delay / 5, f"a rank burnt {cpu:.3f} s of CPU waiting {delay} s: it spun"


def _views_made(comm, n, calls):
    """How many views into segments each allreduce makes after the first (receives only)."""
    buf = comm.empty(n, np.float32)
    buf[:] = comm.rank + 1
    allreduce(comm, buf, "ring")
    made = []
    view = Segment.view

    def counting(self, *args):
        made.append(1)
        return view(self, *args)

    Segment.view = counting
    try:
        for _ in range(calls):
            buf[:] = comm.rank + 1
            allreduce(comm, buf, "ring")
    finally:
        Segment.view = view
    return len(made), buf.tolist()


def test_repeated_collectives_reuse_their_views_into_peer_memory():
    """A chunk's view into the peer's segment is carved once: the 4 KiB all-reduce spent a fifth of
    its receive making it again every call."""
    p, n = 3, 1000
    for made, values in launch(_views_made, p, args=(n, 5), timeout=20):
        assert made == 0
        assert values == [float(sum(range(1, p + 1)))] * n


def _peak_bytes(comm, n):
    buf = comm.empty(n, np.float32)
    buf[:] = comm.rank
    allreduce(comm, buf, "ring")  # mappings and views made, outside the measurement
    tracemalloc.start()
    try:
        buf[:] = comm.rank
        allreduce(comm, buf, "ring")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert buf[0] == sum(range(comm.world_size))
    return peak, comm.bytes_staged


def test_a_shared_memory_allreduce_makes_no_temporary_and_no_copy():
    """1 MiB per rank: numpy adds into the buffer itself (a temporary would trace 512 KiB) and
    nothing is staged."""
    n = 1 << 18
    for peak, staged in launch(_peak_bytes, 2, args=(n,), timeout=20):
        assert peak < 32 * 1024, f"{peak} bytes allocated during a {4 * n}-byte all-reduce"
        assert staged == 0


def _many_segments(comm, count, cache):
    memory.VIEW_CACHE = cache
    got = []
    for i in range(count):
        buf = comm.empty(8, np.int64)
        if comm.rank == 0:
            buf[:] = i
            comm.send(buf, 1)
        else:
            comm.recv(buf, 0)
            got.append(int(buf[0]))
            mapped = set(comm.memory._peers)
            assert len(comm.memory._peers) <= memory.PEER_CACHE
            assert len(comm.memory._views) <= cache
            assert all(key[:2] in mapped for key in comm.memory._views), (
                "a view outlived its mapping"
            )
        comm.barrier()
    return got


def test_views_are_bounded_and_go_with_their_segment():
    count = memory.PEER_CACHE + 8
    assert launch(_many_segments, 2, args=(count, 5), timeout=20)[1] == list(range(count))


def test_a_disabled_tracer_spans_nothing_and_an_enabled_one_records():
    """Every collective enters a span: off, it is one shared do-nothing context (a generator-based
    context manager cost ~2 µs per collective, a tenth of a 4 KiB all-reduce)."""
    from dplab.reference.trace import Tracer

    off, on = Tracer(0), Tracer(1, enabled=True)
    assert off.span("allreduce", bytes=4) is Tracer(2).span("reduce")
    with on.span("allreduce", bytes=4, algorithm="ring"):
        with off.span("allreduce"):
            pass
    (event,) = on.take()
    assert (event.rank, event.kind, event.bytes, event.algorithm) == (1, "allreduce", 4, "ring")
    assert event.t_end_ns >= event.t_start_ns and off.take() == []


class _Sem:
    """A semaphore whose peer is quick (the first try succeeds) or slow (only a sleep succeeds)."""

    def __init__(self, quick: bool) -> None:
        self.quick, self.tries, self.sleeps = quick, 0, 0

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        if not block:
            self.tries += 1
            return self.quick
        self.sleeps += 1
        return True


def _waiter(spin: float) -> Waiter:
    w = Waiter(0, 1, 1.0)
    w.spin, w.budget, w.yields = spin, spin, 0
    return w


def test_the_spin_backs_off_while_waits_sleep_and_comes_back_when_they_do_not():
    """A busy machine (a peer without a core) makes every spin a waste: each wait that ends asleep
    halves the next spin, down to a sixteenth; every eighth wait spins in full, and one quick
    wait restores it."""
    w, spin = _waiter(20e-6), 20e-6
    budgets = []
    for _ in range(7):
        slow = _Sem(quick=False)
        w.acquire(slow, "for its message", 1)
        assert slow.sleeps == 1 and slow.tries > 0
        budgets.append(w.budget)
    assert budgets == [spin / 2, spin / 4, spin / 8, spin / 16, spin / 16, spin / 16, spin / 16]
    probe = _Sem(quick=False)
    w.acquire(probe, "for its message", 1)  # the 8th: a full spin, which fails
    assert w.budget == spin / 2
    quick = _Sem(quick=True)
    w.acquire(quick, "for its message", 1)
    assert (quick.tries, quick.sleeps, w.budget) == (1, 0, spin)


class _Recorder:
    """A communicator that only records what the executor hands it, round by round."""

    backend, rank, world_size = "local", 1, 3

    def __init__(self) -> None:
        from dplab.reference.trace import Tracer

        self.tracer, self.rounds = Tracer(1), []

    def check_buffer(self, buf, call=None) -> None:
        pass

    def exchange(self, sends, recvs, round=-1, algorithm="") -> None:
        self.rounds.append((round, [(s.buf.tolist(), s.peer) for s in sends],
                            [(r.buf.tolist(), r.peer, r.reduce) for r in recvs]))


def test_the_engine_cuts_a_plans_chunks_once_per_buffer_length(monkeypatch):
    """Chunk bounds and message spans are worked out once per (plan, length), then reused: the
    executor spent ~1.5 µs a call recomputing them. The slices handed over stay the same."""
    from dplab.backends.fastpath import executor

    calls = []
    bounds = executor.chunk_bounds
    monkeypatch.setattr(executor, "chunk_bounds", lambda n, k: calls.append((n, k)) or bounds(n, k))
    monkeypatch.setattr(executor, "_ROUNDS", {})
    comm, seen = _Recorder(), []
    for n in (7, 7, 7, 10, 7):
        comm.rounds = []
        executor.allreduce(comm, np.arange(n, dtype=np.float64), "ring")
        seen.append(comm.rounds)
    assert calls == [(7, 3), (10, 3)]
    assert seen[0] == seen[1] == seen[4] != seen[3]
    _, plan = executor.schedule_plan("allreduce", "ring", 3, 1)
    for n, rounds in ((7, seen[0]), (10, seen[3])):
        assert rounds == _expected_rounds(
            plan, bounds(n, 3), np.arange(n, dtype=np.float64).tolist()
        )


def _expected_rounds(plan, cut, x):
    """What the executor hands over, worked out from the plan as it did before it cached."""
    def part(m):
        return x[cut[m.chunk][0]:cut[m.stop - 1][1]]

    return [
        (k, [(part(m), m.dst) for m in sends], [(part(m), m.src, m.op == "reduce") for m in recvs])
        for k, (sends, recvs) in enumerate(plan)
        if sends or recvs
    ]
