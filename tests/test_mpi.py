"""The MPI backend: point-to-point semantics, collectives, failures, training, real mpiexec.

Ranks are fresh interpreters started by ``mpiexec`` (dplab.backends.launch.world), so every job is a
module-level function of this file: the ranks import it to unpickle the job. Persistent
worlds (one per world size, for this module) keep start-up to about a second per size;
tests that make ranks fail or time out use worlds of their own. The last tests run
``mpiexec -n 4 dplab train`` exactly as a user types it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tiers import sampled

from dplab.backends.launch.world import RankError, World, launch
from dplab.backends.mpi.setup import available
from dplab.reference import collectives
from dplab.reference.communicator import ANY_SOURCE, CommError, CommTimeout
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

REASON = available()
if REASON:
    pytest.skip(f"MPI backend unavailable: {REASON}", allow_module_level=True)

pytestmark = pytest.mark.mpi
ALGORITHMS = ("naive", "ring", "tree", "direct", "native")
DTYPES = ("float32", "float64", "int64", "int32")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(worlds):
    """``world(p)``: the session's persistent MPI world of ``p`` ranks (started on first use). Not
    one of this module's own: each MPI world start is 5-16 CPU seconds, and the conformance tests
    start the same sizes."""
    return lambda p: worlds(p, "mpi")


@pytest.fixture(scope="module")
def world_to_break() -> Iterator[World]:
    """This module's own MPI world of 3 ranks, for the jobs that fail on purpose: a failed job ends
    its world's ranks, and the session's world of 3 would then start fresh interpreters that
    import torch and the tests' modules again for the next file (4-5 CPU-s a rank), where this
    one's ranks import neither."""
    with World(3, backend="mpi", timeout=float(os.environ.get("DPLAB_TIMEOUT", "30"))) as w:
        yield w


# -- jobs (run on the ranks) --------------------------------------------------------------------

def job_send_recv(comm):
    """Rank 0 sends every dtype and a few lengths to each other rank, which names the source."""
    got = []
    for dtype in ("float64", "float32", "int32", "int64", "uint8", "float16"):
        for n in (0, 1, 4099):
            if comm.rank == 0:
                for dst in range(1, comm.world_size):
                    comm.send((np.arange(n) * dst).astype(dtype), dst)
            else:
                buf = np.full(n, 99, dtype)
                got.append((dtype, n, comm.recv(buf, 0), buf))
    return got


def job_out_of_order_waits(comm, count):
    if comm.rank == 0:
        reqs = [comm.isend(np.full(5, i, np.int64), 1, tag=i) for i in range(count)]
        for req in reversed(reqs):
            assert req.wait() is None
        return None
    bufs = [np.full(5, -1, np.int64) for _ in range(count)]
    reqs = [comm.irecv(b, 0, tag=i) for i, b in enumerate(bufs)]
    sources = {i: reqs[i].wait() for i in [*range(1, count, 2), *range(0, count, 2)]}
    assert reqs[0].wait() == 0  # waiting again returns the same source
    return sources, [b.tolist() for b in bufs]


def job_any_source(comm):
    if comm.rank == 0:
        got = []
        for i in range(comm.world_size - 1):
            buf = np.zeros(3, np.int64)
            src = comm.irecv(buf, ANY_SOURCE).wait() if i % 2 else comm.recv(buf, ANY_SOURCE)
            got.append((src, buf.tolist()))
        return got
    time.sleep(0.003 * (comm.world_size - comm.rank))  # arrive in another order than rank order
    comm.send(np.full(3, comm.rank, np.int64), 0)
    return None


def job_p2p_misuse(comm):
    """Every misuse a receiver can meet; returns (error type, message) for each."""
    peer = 1 - comm.rank
    out = []
    for sent, expected in (((5, "float64"), (4, "float64")), ((3, "float64"), (4, "float64")),
                           ((4, "int64"), (4, "float64")), ((4, "float64"), (4, "float64"))):
        req = comm.isend(np.zeros(*sent), peer, tag=5)
        try:
            comm.recv(np.zeros(*expected), peer, tag=0 if sent == expected else 5)
            out.append(None)
        except CommError as e:
            out.append((type(e).__name__, str(e)))
        req.wait()
    for call in (
        lambda: comm.send(np.zeros(1), comm.rank),
        lambda: comm.send(np.zeros(1), 7),
        lambda: comm.irecv(np.zeros(1), -5),
        lambda: comm.send(np.zeros((4, 4))[:, ::2], peer),
        lambda: comm.irecv(np.zeros((4, 4))[:, ::2], peer),
    ):
        try:
            call()
            out.append(None)
        except CommError as e:
            out.append((type(e).__name__, str(e)))
    comm.barrier()
    return out


def job_barrier(comm):
    if comm.rank == comm.world_size - 1:
        time.sleep(0.05)
    entered = time.perf_counter_ns()
    comm.barrier()
    return entered, time.perf_counter_ns()


def rank_data(rank: int, n: int, dtype: str) -> np.ndarray:
    """Small integers: sums are exact in every dtype, so results can be compared bit for bit."""
    return np.random.default_rng([n, rank]).integers(-1000, 1001, n).astype(dtype)


def job_allreduce_all(comm, algorithm, lengths):
    out = []
    for dtype in DTYPES:
        for n in lengths:
            buf = rank_data(comm.rank, n, dtype)
            assert collectives.allreduce(comm, buf, algorithm) is buf
            out.append((dtype, n, buf))
    return out


def job_other_collectives(comm, n):
    p, out = comm.world_size, {}
    for algorithm in ("ring", "direct"):
        buf = rank_data(comm.rank, n, "int64")
        out["reduce_scatter", algorithm] = collectives.reduce_scatter(comm, buf, algorithm).copy()
        buf = np.full(n, -1, np.int64)
        a, b = chunk_bounds(n, p)[comm.rank]
        buf[a:b] = rank_data(comm.rank, n, "int64")[a:b]
        out["allgather", algorithm] = collectives.allgather(comm, buf, algorithm).copy()
    for algorithm in ("tree", "naive"):
        for root in range(p):
            buf = rank_data(comm.rank, n, "float64")
            out["reduce", algorithm, root] = collectives.reduce(comm, buf, root, algorithm).copy()
            buf = rank_data(root, n, "float64") if comm.rank == root else np.zeros(n)
            out["broadcast", algorithm, root] = collectives.broadcast(
                comm, buf, root, algorithm
            ).copy()
    return out


def job_native_ops(comm):
    mean = np.full(5, float(comm.rank))
    comm.native_allreduce(mean, "mean")
    errors = []
    for buf, op in ((np.zeros(3), "max"), (np.zeros(3, np.int64), "mean")):
        try:
            comm.native_allreduce(buf, op)
        except ConfigError as e:
            errors.append(str(e))
    return mean, errors, comm.allgather_object({"rank": comm.rank})


def job_traced_ring(comm, n):
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        collectives.allreduce(comm, np.full(n, comm.rank, np.float64), "ring")
    finally:
        comm.tracer.enabled = False
    return comm.tracer.take()


def job_mismatch(comm, algorithm, kind):
    n, dtype = 10, "float64"
    if comm.rank == 2:
        n, dtype = {"length": (11, dtype), "dtype": (10, "int64"), "length<p": (2, dtype)}[kind]
    elif kind == "length<p":
        n = 1
    return collectives.allreduce(comm, np.ones(n, dtype), algorithm)


def job_fail(comm, bad, folder, how):
    Path(folder, f"rank{comm.rank}").write_text(f"{os.getpid()} {os.getppid()} {os.getpgrp()}")
    comm.barrier()  # every pid is on disk before anyone fails
    if comm.rank == bad:
        if how == "raise":
            raise ValueError(f"the original message from rank {comm.rank}")
        os.kill(os.getpid(), signal.SIGKILL)
    comm.recv(np.zeros(1), bad)  # blocked until the launcher stops us


def job_silence(comm, what):
    """Rank 0 waits for something rank 1 never does; returns the error and how long it took."""
    if comm.rank == 1:
        return None
    t0, comm.timeout = time.monotonic(), 1.0  # this world started with a longer one
    try:
        if what == "recv":
            comm.recv(np.zeros(2), 1)
        elif what == "any":
            comm.recv(np.zeros(2), ANY_SOURCE)
        elif what == "send":  # large: no eager delivery, MPI waits for a matching receive
            comm.send(np.zeros(1 << 20), 1)
        else:
            comm.barrier()
    except CommTimeout as e:
        return str(e), time.monotonic() - t0
    finally:
        comm.timeout = 20.0
    return None


def job_recv_forever(comm):
    if comm.rank == 0:
        comm.recv(np.zeros(1), 1)


# -- point to point ---------------------------------------------------------------------------

def test_importing_the_backend_does_not_start_mpi():
    """Importing mpi4py.MPI calls MPI_Init: the launcher (and pytest) must never do that."""
    code = ("import sys, dplab.backends.mpi.comm, dplab.backends.mpi.setup as m; "
            "print(m.available(), 'mpi4py.MPI' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.stdout.split() == ["None", "False"], run.stderr


def test_send_recv_delivers_every_dtype_and_names_the_source(world):
    results = world(3).run(job_send_recv)
    assert results[0] == []
    for dst in (1, 2):
        assert len(results[dst]) == 18
        for dtype, n, src, buf in results[dst]:
            assert src == 0 and buf.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(buf, (np.arange(n) * dst).astype(dtype))


def test_irecvs_complete_in_posting_order_whatever_order_they_are_waited(world):
    _, (sources, bufs) = world(2).run(job_out_of_order_waits, 9)
    assert sources == {i: 0 for i in range(9)}
    assert bufs == [[i] * 5 for i in range(9)]


@pytest.mark.parametrize("p", [3, 4])
def test_any_source_receives_every_source_exactly_once(world, p):
    got, *rest = world(p).run(job_any_source)
    assert rest == [None] * (p - 1)
    assert sorted(src for src, _ in got) == list(range(1, p))
    assert all(data == [src] * 3 for src, data in got)


def test_wrong_length_dtype_tag_and_peer_raise_clear_errors(world):
    for errors in world(2).run(job_p2p_misuse):
        longer, shorter, dtype, tag, *misuse = errors
        for err, sent in ((longer, "more than 4 x float64"), (shorter, "3 x float64"),
                          (dtype, "4 x int64")):
            assert err[0] == "BufferMismatch" and sent in err[1], err
            assert "expected 4 x float64" in err[1] and "same length and dtype" in err[1]
        assert tag[0] == "CommError" and "expected tag 0" in tag[1] and "got tag 5" in tag[1]
        assert all(e is not None and e[0] == "CommError" for e in misuse), misuse
        assert "is not another rank" in misuse[0][1] and "peer 7" in misuse[1][1]
        assert (
            "peer -5" in misuse[2][1]
            and "contiguous" in misuse[3][1]
            and "contiguous" in misuse[4][1]
        )


def test_barrier_holds_everyone_until_the_last_arrives(world):
    results = world(4).run(job_barrier)
    assert min(left for _, left in results) >= max(entered for entered, _ in results)


# -- collectives --------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
# p = 1 is slow: an MPI world of its own for it alone (the local backend runs p = 1 by default)
@pytest.mark.parametrize("p", [pytest.param(1, marks=pytest.mark.slow), 2, 3, 4])
def test_allreduce_is_exact_and_bitwise_identical_on_every_rank(world, p, algorithm):
    lengths = sorted({0, 1, 2, 7, 13, 31, 1009, 65_537, max(p - 1, 0)})
    per_rank = world(p).run(job_allreduce_all, algorithm, lengths)
    for i, (dtype, n, out) in enumerate(per_rank[0]):
        expected = sum(rank_data(r, n, "int64") for r in range(p)).astype(dtype)
        assert out.dtype == np.dtype(dtype) and np.array_equal(out, expected), (dtype, n)
        assert all(r[i][2].tobytes() == out.tobytes() for r in per_rank), (dtype, n)


@pytest.mark.parametrize("p, n", [(3, 10), (4, 3), (4, 1001)])
def test_reduce_scatter_allgather_reduce_broadcast(world, p, n):
    results = world(p).run(job_other_collectives, n)
    total = sum(rank_data(r, n, "int64") for r in range(p))
    gathered = np.concatenate(
        [rank_data(r, n, "int64")[a:b] for r, (a, b) in enumerate(chunk_bounds(n, p))]
    )
    for rank, out in enumerate(results):
        a, b = chunk_bounds(n, p)[rank]
        for algorithm in ("ring", "direct"):
            np.testing.assert_array_equal(out["reduce_scatter", algorithm], total[a:b])
            np.testing.assert_array_equal(out["allgather", algorithm], gathered)
        for algorithm in ("tree", "naive"):
            for root in range(p):
                expected = rank_data(root, n, "float64")
                np.testing.assert_array_equal(out["broadcast", algorithm, root], expected)
                if rank == root:
                    np.testing.assert_array_equal(
                        out["reduce", algorithm, root], total.astype(np.float64)
                    )


def test_native_mean_op_errors_and_allgather_object(world):
    for mean, errors, gathered in world(3).run(job_native_ops):
        np.testing.assert_array_equal(mean, np.full(5, 1.0))
        assert len(errors) == 2 and "'max'" in errors[0] and "int64" in errors[1]
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


def test_a_traced_ring_records_every_transfer(world):
    p, n = 3, 10
    for rank, events in enumerate(world(p).run(job_traced_ring, n)):
        kinds = [e.kind for e in events]
        assert kinds.count("send") == 2 * (p - 1) and kinds.count("allreduce") == 1
        assert kinds.count("reduce") == kinds.count("copy") == p - 1
        assert all(e.rank == rank and e.t_start_ns <= e.t_end_ns for e in events)
        assert {e.peer for e in events if e.kind == "send"} == {(rank + 1) % p}
        assert {e.peer for e in events if e.kind in ("reduce", "copy")} == {(rank - 1) % p}


# -- failures -------------------------------------------------------------------------------

# Each case restarts the world (a failed job ends its ranks): one of each kind and each way the
# transport runs a collective (a schedule, MPI's own) by default, every algorithm in the slow tier
MISMATCHES = [(a, "length") for a in ALGORITHMS] + [
    ("ring", "dtype"), ("native", "dtype"), ("tree", "length<p")]


@pytest.mark.parametrize("algorithm, kind", sampled(
    MISMATCHES, keep={"ring-length", "native-length", "native-dtype", "tree-length<p"},
    ids=[f"{a}-{k}" for a, k in MISMATCHES]))
def test_mismatched_buffers_fail_fast_with_buffer_mismatch(world_to_break, algorithm, kind):
    w = world_to_break  # started before the clock: under load a start alone can take 15 s
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        w.run(job_mismatch, algorithm, kind)
    assert time.monotonic() - t0 < w.timeout, "found by the timeout, not by the buffer check"
    assert "BufferMismatch" in str(err.value) and "same length and dtype" in str(err.value)
    assert len(w.run(job_barrier)) == 3  # the world restarts after a failure


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.parametrize("how, bad", [("raise", 2), ("raise", 0), ("kill", 1)])
def test_a_failing_rank_stops_the_world_fast_and_leaves_nothing(tmp_path, how, bad):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_fail, 4, backend="mpi", args=(bad, str(tmp_path), how), timeout=120.0)
    # well before the survivors' timeout (the world's start is in the clock: 15 s under load)
    assert time.monotonic() - t0 < 60
    assert err.value.rank == bad
    if how == "raise":
        assert "Traceback" in err.value.detail
        assert f"ValueError: the original message from rank {bad}" in str(err.value)
    else:
        assert "died" in str(err.value)
    ranks = [tuple(map(int, f.read_text().split())) for f in sorted(tmp_path.glob("rank*"))]
    assert len(ranks) == 4
    pids = {pid for rank in ranks for pid in rank[:2]}  # the ranks and mpiexec's proxy
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_gone(pid) for pid in pids):
        time.sleep(0.05)
    assert [pid for pid in pids if not _gone(pid)] == [], "MPI processes outlived the launch"
    assert [m for *_, group in ranks for m in _group_members(group)] == []


def test_waiting_for_a_silent_peer_times_out_naming_it():
    with World(2, backend="mpi", timeout=20.0) as w:  # its own: timeouts leave messages behind
        for what, peer in (("recv", "rank 1"), ("any", "any rank"), ("send", "rank 1"),
                           ("barrier", "every rank")):
            (message, waited), none = w.run(job_silence, what)
            assert none is None and 0.9 <= waited < 5, (what, waited)
            assert "waited 1s" in message and peer in message, message
    with pytest.raises(RankError) as err:
        launch(job_recv_forever, 2, backend="mpi", timeout=2.0)
    assert err.value.rank == 0 and "CommTimeout" in str(err.value) and "waited 2s" in str(err.value)


# -- training -------------------------------------------------------------------------------

@pytest.mark.parametrize("p, algorithm, global_batch, accum_steps, dtype", [
    (4, "ring", 30, 1, "float64"),   # 30 samples over 4 ranks: shards of 8, 8, 7, 7
    (3, "tree", 16, 2, "float64"),   # two micro-batches per step
    (2, "native", 9, 1, "float64"),
    (4, "naive", 3, 2, "float32"),   # shards smaller than the world, empty micro-batches
])
def test_train_sync_on_mpi_equals_train_single(
    world, p, algorithm, global_batch, accum_steps, dtype
):
    cfg = TrainConfig(num_samples=64, global_batch=global_batch, steps=4, seed=5, dtype=dtype)
    results = world(p).run(train_sync, cfg, SyncConfig(algorithm, 1e-3, accum_steps))
    single = train_single(cfg)
    tol = 1e-10 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(results[0].params, single.params, rtol=tol, atol=tol)
    assert all(np.array_equal(r.params, results[0].params) for r in results)


# -- under mpiexec, as a user types it -------------------------------------------------------

def _mpiexec(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "DPLAB_"))}
    return subprocess.run([MPIEXEC, "-n", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dplab_train_under_mpiexec_matches_single_device(tmp_path):
    out = tmp_path / "row.json"
    run = _mpiexec("4", sys.executable, "-m", "dplab.backends.cli", "train", "--backend", "mpi",
                   "--steps", "5", "--json", str(out))
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["world_size"] == 4 and row["backend"] == "mpi" and row["ranks_identical"]
    assert row["max_abs_diff_vs_single"] < 1e-12
    assert run.stdout.count("max_abs_diff_vs_single") == 1, "only rank 0 prints the table"


def test_the_dplab_script_under_mpiexec():
    run = _mpiexec("4", str(Path(sys.executable).parent / "dplab"), "train", "--backend", "mpi",
                   "--steps", "5", "--algorithm", "tree")
    assert run.returncode == 0, run.stderr
    line = [ln for ln in run.stdout.splitlines() if ln.strip().startswith("mpi")]
    assert len(line) == 1 and " tree " in line[0] and " 4 " in line[0] and "True" in line[0]


FAILING = """
import numpy as np
from dplab.backends.launch.world import launch
def fn(comm):
    if comm.rank == 1:
        raise ValueError("planned failure on rank 1")
    comm.recv(np.zeros(1), 1)
launch(fn, backend="mpi", timeout=120)
"""


def test_a_failing_rank_under_mpiexec_aborts_the_job_instead_of_hanging():
    t0 = time.monotonic()
    run = _mpiexec("3", sys.executable, "-c", FAILING)
    assert time.monotonic() - t0 < 60, "the other ranks waited for their timeout (120 s)"
    assert run.returncode != 0 and "planned failure on rank 1" in run.stderr


def _unmapped_mpich_segments() -> set[str]:
    """MPICH segments in /dev/shm that no live process maps: what killed ranks leave behind."""
    names = {str(p) for p in Path("/dev/shm").glob("mpich_shm_*")}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        names = {n for n in names if n not in text}
    return names


def test_an_aborted_world_leaves_no_mpich_segments_in_dev_shm(tmp_path):
    """Killed ranks never reach MPI_Finalize, where MPICH unlinks its shared memory."""
    for _ in range(2):
        with pytest.raises(RankError):
            launch(train_sync, 4, backend="mpi", args=(TrainConfig(steps=1, global_batch=0),))
        assert _unmapped_mpich_segments() == set()


def job_train_until_rank_dies(comm, victim):
    """Everyone trains; ``victim`` SIGKILLs itself a moment in, mid-collective for the others."""
    if comm.rank == victim:
        import threading

        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return train_sync(comm, TrainConfig(steps=10**6), SyncConfig("ring")).params


@pytest.mark.parametrize("victim", [2, 3])
def test_a_rank_killed_mid_training_is_the_one_named(victim):
    """mpiexec then terminates every other rank; the error must still name the one that died."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_train_until_rank_dies, 4, backend="mpi", args=(victim,), timeout=120.0)
    assert time.monotonic() - t0 < 60  # not the survivors' 120 s timeout
    assert err.value.rank == victim, str(err.value)
    assert _unmapped_mpich_segments() == set()


def job_empty_native_then_ring(comm, late):
    """A checked native all-reduce of nothing, then a ring. Rank ``late`` sends its last round of
    the buffer check 0.3 s late: rank (late - 1), whose last round waits for it, is still in the
    check when the others, done with theirs, send it their ring messages."""
    import time
    import types

    from dplab.reference.collectives import allreduce

    if comm.rank == late:
        real, calls = comm.MPI, []

        def startall(reqs):
            calls.append(1)
            if len(calls) == 3:  # p = 5: rounds k = 1, 2, 4; the third is the last
                time.sleep(0.3)
            return real.Prequest.Startall(reqs)

        class Late:
            Prequest = types.SimpleNamespace(Startall=startall)

            def __getattr__(self, name):
                return getattr(real, name)

        comm.MPI = Late()
    comm.native_allreduce(np.empty(0, np.float64))
    x = np.full(5, comm.rank + 1.0)
    allreduce(comm, x, "ring")
    return x


def test_a_checked_native_of_nothing_holds_every_rank_until_all_have_checked():
    """MPI_Allreduce of 0 elements synchronises no one: a rank out of the native's buffer check
    early reached a peer still in it, whose peek took the next collective's message for a mismatch
    (a false CollectiveMismatch, seen under load at p = 5)."""
    p = 5
    for got in launch(job_empty_native_then_ring, p, backend="mpi", args=(1,)):
        assert np.array_equal(got, np.full(5, p * (p + 1) / 2))
