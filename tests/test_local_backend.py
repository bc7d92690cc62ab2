"""The local backend and launcher: point-to-point semantics, failures, clean-up, traces.

Jobs sent to a persistent ``World`` are module-level functions (they are pickled);
``launch`` forks, so its tests use closures freely.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.launch.world import BackendUnavailable, RankError, World, launch
from dplab.backends.local import shm
from dplab.reference.collectives import allreduce
from dplab.reference.communicator import ANY_SOURCE, BufferMismatch, CommError, CommTimeout
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.trace import Event, align_clock, load_json, merge, save_json, to_chrome


def segments_of(session: str) -> list[str]:
    return [name for name in shm.leftovers() if name.startswith(session)]


# -- jobs for persistent worlds -----------------------------------------------------------

def job_send_recv(comm, dtype, n, how):
    """Rank 0 sends to every other rank in turn; each returns (source, data)."""
    make = comm.empty if how == "shm" else np.empty
    if comm.rank == 0:
        for dst in range(1, comm.world_size):
            buf = make(n, dtype)
            buf[...] = np.arange(n) * dst
            comm.send(buf, dst)
        return None
    buf = make(n, dtype)
    buf[...] = 99  # not a value any message carries at most places
    return comm.recv(buf, 0), np.array(buf, copy=True)


def job_out_of_order_waits(comm, count):
    if comm.rank == 0:
        reqs = []
        for i in range(count):
            msg = np.full(5, i, np.int64)
            reqs.append((comm.isend(msg, 1, tag=i), msg))
        for req, _ in reversed(reqs):
            req.wait()
        return None
    bufs = [np.full(5, -1, np.int64) for _ in range(count)]
    reqs = [comm.irecv(b, 0, tag=i) for i, b in enumerate(bufs)]
    order = list(range(count))[::-1]
    order = order[1::2] + order[::2]  # wait in a scrambled order
    sources = {i: reqs[i].wait() for i in order}
    return sources, [b.tolist() for b in bufs]


def job_any_source(comm):
    """Ranks 1..p-1 each send their rank once; rank 0 takes them with ANY_SOURCE."""
    if comm.rank == 0:
        got = []
        for i in range(comm.world_size - 1):
            buf = np.zeros(3, np.int64)
            if i % 2:
                src = comm.irecv(buf, ANY_SOURCE).wait()
            else:
                src = comm.recv(buf, ANY_SOURCE)
            got.append((src, buf.tolist()))
        return got
    if comm.rank % 2:
        time.sleep(0.002 * comm.rank)  # arrive in some other order than rank order
    comm.send(np.full(3, comm.rank, np.int64), 0)
    return None


def job_tag_mismatch(comm):
    if comm.rank == 1:
        comm.send(np.arange(4, dtype=np.float64), 0, tag=5)
        comm.send(np.arange(4, dtype=np.float64), 0, tag=6)
        return None
    buf = np.zeros(4)
    try:
        comm.recv(buf, 1, tag=0)
    except CommError as e:
        mismatch = (type(e).__name__, str(e))
    src = comm.recv(buf, 1, tag=6)  # the next message still arrives, in order
    return mismatch, src, buf.tolist()


def job_barrier(comm, sleeper):
    if comm.rank == sleeper:
        time.sleep(0.05)
    entered = time.perf_counter_ns()
    comm.barrier()
    left = time.perf_counter_ns()
    comm.barrier()  # and again: barriers can follow each other
    return entered, left


def job_bad_peers(comm):
    errors = []
    for call in (lambda: comm.send(np.zeros(1), comm.rank), lambda: comm.send(np.zeros(1), 7),
                 lambda: comm.recv(np.zeros(1), comm.rank), lambda: comm.irecv(np.zeros(1), -5),
                 lambda: comm.send(np.zeros((4, 4))[:, ::2], 1 - comm.rank)):
        try:
            call()
            errors.append(None)
        except CommError as e:
            errors.append(str(e))
    return errors


def job_recv_into_noncontiguous(comm):
    if comm.rank == 0:
        comm.send(np.arange(1.0, 7.0).reshape(3, 2), 1)
        return None
    target = np.zeros((3, 4))
    try:
        comm.recv(target[:, :2], 0)
    except CommError as e:
        return "raised", str(e)
    return "received", target.tolist()


def job_many_in_flight(comm, count):
    """More isends in flight than a mailbox has slots; the receiver drains them in order."""
    if comm.rank == 0:
        msgs = [np.full(3, i, np.int32) for i in range(count)]
        reqs = [comm.isend(m, 1) for m in msgs]
        for r in reqs:
            r.wait()
        return None
    out = []
    buf = np.zeros(3, np.int32)
    for _ in range(count):
        comm.recv(buf, 0)
        out.append(int(buf[0]))
    return out


def job_rank_info(comm, i):
    comm.barrier()
    return comm.rank, comm.world_size, i


def job_fail_on(comm, bad_rank):
    if comm.rank == bad_rank:
        raise RuntimeError(f"planned failure on rank {comm.rank}")
    comm.recv(np.zeros(1), bad_rank)  # would wait forever without the launcher's abort
    return comm.rank


def job_session(comm):
    comm.kept = comm.empty(8, "float64")  # alive after the job: its segment must stay
    return comm.w.session


def job_drop_buffers(comm, n):
    """Allocate and drop n shared buffers; returns this rank's segment count before and after."""
    mine = f"{comm.w.session}_r{comm.rank}_"
    before = sum(name.startswith(mine) for name in shm.leftovers())
    for i in range(n):
        buf = comm.empty(1000, "float64")
        buf[:] = i
        allreduce(comm, buf, "ring")
    del buf
    return before, sum(name.startswith(mine) for name in shm.leftovers())


def job_recv_nothing(comm, any_source):
    if comm.rank == 1:
        return None
    t0 = time.monotonic()
    try:
        comm.recv(np.zeros(2), ANY_SOURCE if any_source else 1)
    except CommTimeout as e:
        return type(e).__name__, isinstance(e, CommError), str(e), time.monotonic() - t0
    return None


def job_send_to_nobody(comm):
    if comm.rank == 1:
        return None
    t0 = time.monotonic()
    try:
        comm.send(np.zeros(2), 1)
    except CommTimeout as e:
        return str(e), time.monotonic() - t0
    return None


def job_traced_ring(comm, n):
    comm.tracer.enabled = True
    comm.tracer.take()
    try:
        buf = comm.empty(n, "float64")
        buf[:] = comm.rank
        allreduce(comm, buf, algorithm="ring")
        return comm.tracer.take(), buf.tolist()
    finally:
        comm.tracer.enabled = False


def job_untraced_allreduce(comm):
    buf = np.full(5, comm.rank, np.float64)
    allreduce(comm, buf, algorithm="ring")
    return comm.tracer.enabled, len(comm.tracer.events), buf.tolist()


def job_align_clock(comm):
    try:
        offset = align_clock(comm)
        return offset, comm.tracer.offset_ns
    finally:
        comm.tracer.offset_ns = 0


def job_leak(comm, iterations):
    for i in range(iterations):
        buf = comm.empty(16, "float64")
        buf[:] = i
        allreduce(comm, buf, algorithm="direct")
    return len(os.listdir("/proc/self/fd"))


# -- point to point -------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["shm", "numpy"])
@pytest.mark.parametrize("dtype,n", [("float64", 10), ("float32", 1), ("int32", 0), ("int64", 4099),
                                     ("uint8", 33), ("float16", 7)])
def test_send_recv_delivers_the_data_and_names_the_source(worlds, dtype, n, how):
    results = worlds(3).run(job_send_recv, dtype, n, how)
    assert results[0] is None
    for dst in (1, 2):
        src, data = results[dst]
        assert src == 0 and data.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(data, (np.arange(n) * dst).astype(dtype))


def test_out_of_order_waits_on_one_source_deliver_in_posting_order(worlds):
    count = 9
    _, (sources, bufs) = worlds(2).run(job_out_of_order_waits, count)
    assert sources == {i: 0 for i in range(count)}
    assert bufs == [[i] * 5 for i in range(count)]


@pytest.mark.parametrize("p", [2, 3, 6])
def test_any_source_returns_every_source_exactly_once(worlds, p):
    got, *rest = worlds(p).run(job_any_source)
    assert rest == [None] * (p - 1)
    assert sorted(src for src, _ in got) == list(range(1, p))
    assert all(data == [src] * 3 for src, data in got)  # the source named is the one that sent


def test_tag_mismatch_raises_comm_error_and_keeps_order(worlds):
    (mismatch, src, data), _ = worlds(2).run(job_tag_mismatch)
    name, message = mismatch
    assert name == "CommError" and "tag 0" in message and "tag 5" in message
    assert src == 1 and data == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("p", [1, 2, 5, 8])
def test_barrier_holds_everyone_until_the_last_arrives(worlds, p):
    results = worlds(p).run(job_barrier, p - 1)
    last_in = max(entered for entered, _ in results)
    first_out = min(left for _, left in results)
    assert first_out >= last_in  # one shared monotonic clock on one machine
    assert first_out >= results[p - 1][0] + (0 if p > 1 else -10**9)


def test_bad_peers_and_noncontiguous_sends_raise_comm_error(worlds):
    for rank, errors in enumerate(worlds(2).run(job_bad_peers)):
        assert all(isinstance(e, str) for e in errors), errors
        assert f"peer {rank} is not another rank" in errors[0]
        assert "peer 7" in errors[1] and "peer -5" in errors[3]
        assert "contiguous" in errors[4]


def test_recv_into_a_noncontiguous_view_fills_it_or_raises(worlds):
    """Send refuses non-contiguous buffers; recv must not silently drop the data either."""
    _, (outcome, detail) = worlds(2).run(job_recv_into_noncontiguous)
    if outcome == "raised":
        assert "contiguous" in detail
    else:
        assert np.array_equal(np.array(detail)[:, :2], np.arange(1.0, 7.0).reshape(3, 2)), (
            f"recv into a non-contiguous view returned normally but left it unfilled: {detail}")


def test_more_messages_in_flight_than_mailbox_slots(worlds):
    _, got = worlds(2).run(job_many_in_flight, 200)
    assert got == list(range(200))


def test_buffers_from_comm_empty_live_in_the_worlds_shared_memory(worlds):
    world = worlds(2)
    sessions = world.run(job_session)
    assert sessions == [world.session] * 2
    assert any(name.startswith(f"{world.session}_r1_") for name in shm.leftovers())


# -- launch ----------------------------------------------------------------------------------

def test_launch_returns_results_in_rank_order():
    base = 10
    assert launch(lambda comm: comm.rank * base, 4) == [0, 10, 20, 30]
    assert launch(lambda comm, a, b: (comm.rank, comm.world_size, a + b), 3, args=(1, 2)) == [
        (0, 3, 3), (1, 3, 3), (2, 3, 3)]
    slow_first = launch(lambda comm: time.sleep(0.05 * (3 - comm.rank)) or comm.rank, 3)
    assert slow_first == [0, 1, 2]


def test_launch_runs_a_collective_on_fresh_ranks():
    def fn(comm):
        buf = comm.empty(17, "int64")
        buf[:] = np.arange(17) + comm.rank
        return allreduce(comm, buf, "tree").tolist()

    assert launch(fn, 5) == [(5 * np.arange(17) + 10).tolist()] * 5


@pytest.mark.parametrize("bad_rank", [0, 2])
def test_a_rank_that_raises_fails_launch_fast_naming_it(tmp_path, bad_rank):
    record = tmp_path / "session"

    def fn(comm):
        keep = comm.empty(1000, "float64")  # noqa: F841 - a live segment to clean up
        if comm.rank == 0:
            record.write_text(comm.w.session)
        if comm.rank == bad_rank:
            time.sleep(0.05)
            raise ValueError(f"the original message from rank {comm.rank}")
        comm.recv(np.zeros(1), bad_rank)  # blocked until the launcher kills us

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 4)
    assert time.monotonic() - t0 < 30  # not the survivors' 60 s timeout (loose: load)
    assert err.value.rank == bad_rank
    assert isinstance(err.value, DplabError)
    assert f"the original message from rank {bad_rank}" in str(err.value)
    assert "ValueError" in str(err.value) and "Traceback" in err.value.detail
    session = record.read_text()
    assert session.startswith(shm.PREFIX)
    assert segments_of(session) == []
    assert not list(Path("/dev/shm").glob(session + "*"))


def test_a_rank_killed_by_sigkill_fails_launch_naming_the_signal(tmp_path):
    record = tmp_path / "session"

    def fn(comm):
        keep = comm.empty(1000, "float64")  # noqa: F841 - a live segment to clean up
        if comm.rank == 1:
            record.write_text(comm.w.session)
            assert Path(f"/dev/shm/{comm.w.session}_r1_0").exists()
            os.kill(os.getpid(), signal.SIGKILL)
        comm.recv(np.zeros(1), 1)

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 3)
    assert time.monotonic() - t0 < 30  # not the survivors' 60 s timeout (loose: load)
    assert err.value.rank == 1
    assert "SIGKILL" in str(err.value)
    session = record.read_text()
    assert segments_of(session) == []
    assert not list(Path("/dev/shm").glob(session + "*"))


def test_a_rank_returning_an_unpicklable_result_reports_why():
    """The result travels back by pickle; when that fails the RankError must say so."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(lambda comm: (lambda: "not picklable") if comm.rank == 1 else comm.rank, 2)
    assert time.monotonic() - t0 < 30  # not the 60 s timeout (loose: load)
    assert err.value.rank == 1
    assert "pickle" in str(err.value), str(err.value)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "direct", "native"])
@pytest.mark.parametrize("mismatch", ["length", "dtype", "length<p"])
def test_mismatched_buffers_raise_buffer_mismatch_not_a_hang(algorithm, mismatch):
    def fn(comm):
        n, dtype = 10, "float64"
        if comm.rank == 2:
            n, dtype = {"length": (11, dtype), "dtype": (n, "int64"), "length<p": (2, dtype)}[
                mismatch
            ]
        if mismatch == "length<p":
            n = n if comm.rank == 2 else 1
        return allreduce(comm, np.ones(n, dtype), algorithm=algorithm).tolist()

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 3, timeout=60.0)
    assert time.monotonic() - t0 < 30  # found by the buffer check, not by the 60 s timeout
    assert "BufferMismatch" in str(err.value)
    assert "same length and dtype" in str(err.value)


def test_recv_from_a_silent_peer_times_out():
    with World(2, timeout=1.0) as world:
        for any_source in (False, True):
            t0 = time.monotonic()
            (name, is_comm_error, message, waited), none = world.run(job_recv_nothing, any_source)
            assert none is None and name == "CommTimeout" and is_comm_error
            assert 0.9 <= waited < 30 and time.monotonic() - t0 < 30  # 1 s (loose: load)
            assert "waited 1s" in message and ("rank 1" in message or "any rank" in message)
        message, waited = world.run(job_send_to_nobody)[0]
        assert 0.9 <= waited < 30 and "rank 1" in message
    assert issubclass(CommTimeout, TimeoutError) and issubclass(BufferMismatch, CommError)


def test_launch_with_a_small_timeout_reports_the_timeout():
    def fn(comm):
        if comm.rank == 0:
            comm.recv(np.zeros(1), 1)

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=1.0)
    assert time.monotonic() - t0 < 30  # 1 s, then an end (loose: load)
    assert err.value.rank == 0 and "CommTimeout" in str(err.value)


def test_persistent_world_survives_many_runs_and_restarts_after_failures():
    with World(3, timeout=10.0) as world:
        for i in range(150):
            assert world.run(job_rank_info, i) == [(0, 3, i), (1, 3, i), (2, 3, i)]
        first = world.session
        assert segments_of(first)  # the control segment at least
        for bad in (1, 0):
            with pytest.raises(RankError) as err:
                world.run(job_fail_on, bad)
            assert err.value.rank == bad and f"planned failure on rank {bad}" in str(err.value)
            assert world.run(job_rank_info, 7) == [(0, 3, 7), (1, 3, 7), (2, 3, 7)]
        assert world.session != first and segments_of(first) == []
        session = world.session
    assert segments_of(session) == []


def test_dropped_buffers_give_their_shared_memory_back(worlds):
    """A persistent world must not grow /dev/shm with every comm.empty of every example."""
    for before, after in worlds(3).run(job_drop_buffers, 100):
        assert after == before


def test_closing_a_world_removes_its_shared_memory():
    world = World(3)
    sessions = world.run(job_session)
    assert len(segments_of(sessions[0])) >= 4  # control + one buffer per rank
    world.close()
    assert segments_of(sessions[0]) == []


@pytest.mark.parametrize("bad", [0, -1, "2", 2.5, None])
def test_bad_world_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="world_size"):
        World(bad)
    with pytest.raises(ConfigError, match="world_size"):
        launch(lambda comm: None, bad)


@pytest.mark.parametrize("backend, module", [("mpi", "dplab.backends.mpi.setup"),
                                             ("torch", "dplab.backends.torchdist.setup")])
def test_a_missing_engine_is_unavailable_with_its_reason(backend, module, monkeypatch):
    """When mpi4py/torch is not installed, launching says so and what to install."""
    monkeypatch.setattr(f"{module}.available", lambda: "not installed here: pip install 'dplab[x]'")
    with pytest.raises(BackendUnavailable, match="pip install"):
        launch(lambda comm: None, 2, backend=backend)
    with pytest.raises(BackendUnavailable, match=backend):
        World(2, backend=backend)
    assert issubclass(BackendUnavailable, DplabError)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        launch(lambda comm: None, 2, backend="carrier-pigeon")
    assert "carrier-pigeon" in str(err.value)
    assert all(name in str(err.value) for name in ("local", "mpi", "torch"))


def test_sweep_stale_removes_segments_of_dead_launchers():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{shm.PREFIX}{dead.pid}_cafe0123_ctl"
    seg = shm.Segment(stale, 64, create=True)
    seg.view(0, 64, np.int64)[:] = 5
    other = shm.Segment(stale, 64)  # a second mapping sees the same bytes
    assert other.view(0, 64, np.int64).tolist() == [5] * 8
    other.close()
    seg.close()
    assert stale in shm.leftovers()
    live = f"{shm.PREFIX}{os.getpid()}_livelive_ctl"
    shm.Segment(live, 8, create=True).close()
    try:
        assert shm.sweep_stale() >= 1
        assert stale not in shm.leftovers() and live in shm.leftovers()
    finally:
        assert shm.unlink_prefix(live) == 1
        shm.unlink_prefix(stale)
    assert live not in shm.leftovers()


def test_persistent_world_does_not_leak_a_file_descriptor_per_buffer():
    """A persistent world runs hundreds of examples; ``comm.empty`` per example must not
    exhaust the common default RLIMIT_NOFILE (1024) of a rank."""
    with World(4, timeout=10.0) as world:
        before = world.run(job_leak, 1)
        after = None
        for _ in range(5):
            after = world.run(job_leak, 30)
    assert max(after) < 1024, (
        f"open file descriptors per rank went from {before} to {after} over 150 buffers")


# -- traces ------------------------------------------------------------------------------------

def test_allreduce_trace_records_every_transfer(worlds, tmp_path):
    p, n = 4, 10  # chunks of 3, 3, 2, 2 float64
    results = worlds(p).run(job_traced_ring, n)
    sizes = [(b - a) * 8 for a, b in chunk_bounds(n, p)]
    for rank, (events, values) in enumerate(results):
        assert values == [float(sum(range(p)))] * n
        assert all(e.rank == rank and e.t_start_ns <= e.t_end_ns for e in events)
        span = [e for e in events if e.kind == "allreduce"]
        assert len(span) == 1 and span[0].bytes == n * 8 and span[0].algorithm == "ring"
        sends = sorted((e for e in events if e.kind == "send"), key=lambda e: e.round)
        reduces = sorted((e for e in events if e.kind == "reduce"), key=lambda e: e.round)
        copies = sorted((e for e in events if e.kind == "copy"), key=lambda e: e.round)
        assert len(sends) == 2 * (p - 1) and len(reduces) == len(copies) == p - 1
        for e in sends:
            k = e.round
            chunk = (rank - k - 1) % p if k < p - 1 else (rank - (k - p + 1)) % p
            assert (e.peer, e.chunk, e.bytes, e.algorithm) == ((rank + 1) % p, chunk, sizes[chunk],
                                                               "ring")
        left = (rank - 1) % p
        for k, e in enumerate(reduces):
            chunk = (left - k - 1) % p
            assert (e.round, e.peer, e.chunk, e.bytes) == (k, left, chunk, sizes[chunk])
        for k, e in enumerate(copies):
            chunk = (left - k) % p
            assert (e.round, e.peer, e.chunk, e.bytes) == (p - 1 + k, left, chunk, sizes[chunk])
        inner = [e for e in events if e.kind != "allreduce"]
        assert all(span[0].t_start_ns <= e.t_start_ns and e.t_end_ns <= span[0].t_end_ns
                   for e in inner)

    events = merge(events for events, _ in results)
    assert len(events) == p * (1 + 4 * (p - 1))
    assert [e.t_start_ns for e in events] == sorted(e.t_start_ns for e in events)

    chrome = json.loads(json.dumps(to_chrome(events)))
    t0 = min(e.t_start_ns for e in events)
    xs = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in chrome["traceEvents"] if e["ph"] == "M"]
    assert len(xs) == len(events)
    assert {e["pid"] for e in xs} == set(range(p))
    assert sorted(e["args"]["name"] for e in meta if e["name"] == "process_name") == [
        f"rank {r}" for r in range(p)]
    for x, e in zip(xs, events):
        assert x["pid"] == e.rank and x["ts"] >= 0 and x["dur"] >= 0
        assert x["ts"] == pytest.approx((e.t_start_ns - t0) / 1e3)  # microseconds
        assert x["dur"] == pytest.approx((e.t_end_ns - e.t_start_ns) / 1e3)
        assert x["args"]["bytes"] == e.bytes and x["args"]["round"] == e.round
        assert x["name"].startswith(e.kind)
    sends = [x for x in xs if x["name"].startswith("send")]
    assert all(x["name"] == f"send -> {x['args']['peer']}" for x in sends)

    path = tmp_path / "run.trace.json"
    save_json(path, events, meta={"algorithm": "ring", "world_size": p})
    loaded, meta_back = load_json(path)
    assert loaded == events and meta_back == {"algorithm": "ring", "world_size": p}
    assert all(isinstance(e, Event) for e in loaded)


def test_tracing_is_off_by_default_and_records_nothing(worlds):
    for enabled, count, values in worlds(3).run(job_untraced_allreduce):
        assert enabled is False and count == 0 and values == [3.0] * 5
    assert to_chrome([]) == {"traceEvents": [], "displayTimeUnit": "ns"}


def test_align_clock_recovers_a_simulated_skew():
    """Rank 1's clock runs 5 ms ahead; after align_clock its tracer reads like rank 0's."""
    skew = 5_000_000

    def fn(comm):
        import types

        import dplab.reference.trace as trace

        real = time.perf_counter_ns
        if comm.rank == 1:
            trace.time = types.SimpleNamespace(perf_counter_ns=lambda: real() + skew)
        offset = align_clock(comm, samples=16)
        comm.barrier()
        return offset, comm.tracer.now() - real()

    (offset0, error0), (offset1, error1) = launch(fn, 2)
    assert offset0 == 0 and abs(error0) < 1_000_000
    assert abs(offset1 + skew) < 1_000_000
    assert abs(error1) < 1_000_000  # rank 1's tracer now agrees with the shared clock


@pytest.mark.parametrize("p", [2, 4])
def test_align_clock_on_one_machine_finds_offsets_below_a_millisecond(worlds, p):
    results = worlds(p).run(job_align_clock)
    assert results[0] == (0, 0)
    for offset, applied in results[1:]:
        assert offset == applied
        assert abs(offset) < 1_000_000, f"offset {offset} ns on one machine"


def job_pid_table(comm):
    comm.barrier()
    return [int(comm.w.pids[r]) for r in range(comm.world_size)]


def test_other_worlds_coming_and_going_leave_a_worlds_pid_table_alone():
    """peer_alive reads the pid table: another world must never be handed its memory."""
    with World(3) as world:
        before = world.run(job_pid_table)[0]
        assert 0 not in before
        for _ in range(3):
            with World(3) as other:
                other.run(job_pid_table)
        assert world.run(job_pid_table)[0] == before
