"""The torch.distributed backend: gloo ranks forked by ``World``/``launch``, and under torchrun.

Worlds are the session's (one per size, created on first use): a gloo world starts in a
fraction of a second, but the properties below run hundreds of collectives. Jobs sent to
a persistent world are module-level functions (they are pickled); ``launch`` forks, so
its tests use closures. The ``gpu`` section runs the same checks with NCCL on CUDA
tensors where ``torch.cuda.device_count() >= p``; it skips elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplab.backends.launch.world import RankError, World, launch
from dplab.backends.torchdist.setup import available
from dplab.reference import collectives
from dplab.reference.communicator import ANY_SOURCE, CommError, RecvSpec, SendSpec
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

if available():
    pytest.skip(f"torch backend unavailable: {available()}", allow_module_level=True)

import torch  # noqa: E402  (after the skip: torch may be missing)

pytestmark = pytest.mark.torch

ALGORITHMS = ("naive", "ring", "tree", "direct", "native")
DTYPES = ("float32", "float64", "int64", "int32")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(worlds):
    """``world(p)``: the session's persistent torch world of ``p`` ranks (the conformance tests
    start the same sizes: one start each, not two)."""
    return lambda p: worlds(p, "torch")


def contribution(rank: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Small integers: every sum is exact in every dtype, so ranks must agree bit for bit."""
    return np.random.default_rng([seed, rank]).integers(-500, 501, n).astype(dtype)


def expected(p: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    return sum(contribution(r, n, dtype, seed).astype(np.int64) for r in range(p)).astype(dtype)


def as_kind(a: np.ndarray, kind: str, comm=None):
    if kind == "numpy":
        return a
    device = comm.device if kind == "device" else "cpu"
    return torch.from_numpy(a.copy()).to(device)


def to_numpy(buf) -> np.ndarray:
    return buf.cpu().numpy().copy() if isinstance(buf, torch.Tensor) else np.array(buf, copy=True)


# -- jobs (module level: pickled to the persistent worlds) ----------------------------------

def job_allreduce_grid(comm, algorithm, lengths, kinds, seed):
    out = {}
    for dtype in DTYPES:
        for n in lengths:
            for kind in kinds:
                buf = as_kind(contribution(comm.rank, n, dtype, seed), kind, comm)
                assert collectives.allreduce(comm, buf, algorithm) is buf
                out[(dtype, n, kind)] = to_numpy(buf)
    return out


def job_collectives(comm, n, dtype, root):
    p, r = comm.world_size, comm.rank
    res = {}
    for alg in ("ring", "direct"):
        buf = contribution(r, n, dtype)
        res["rs", alg] = to_numpy(collectives.reduce_scatter(comm, buf, alg))
        a, b = chunk_bounds(n, p)[r]
        buf = np.full(n, -1, dtype)
        buf[a:b] = contribution(r, n, dtype)[a:b]
        res["ag", alg] = to_numpy(collectives.allgather(comm, buf, alg))
    for alg in ("tree", "naive"):
        buf = as_kind(contribution(r, n, dtype) if r == root else np.zeros(n, dtype), "cpu")
        res["bc", alg] = to_numpy(collectives.broadcast(comm, buf, root, alg))
        res["rd", alg] = to_numpy(collectives.reduce(comm, contribution(r, n, dtype), root, alg))
    return res


def job_send_recv(comm, dtype, n, kind):
    if comm.rank == 0:
        for dst in range(1, comm.world_size):
            comm.send(as_kind((np.arange(n) * dst).astype(dtype), kind), dst)
        return None
    buf = as_kind(np.full(n, 99, dtype), kind)
    return comm.recv(buf, 0), to_numpy(buf)


def job_any_source(comm):
    if comm.rank == 0:
        got = []
        for i in range(comm.world_size - 1):
            buf = np.zeros(3, np.int64)
            src = comm.irecv(buf, ANY_SOURCE).wait() if i % 2 else comm.recv(buf)
            got.append((src, buf.tolist()))
        return got
    time.sleep(0.01 * (comm.world_size - comm.rank))  # arrive in reverse rank order
    comm.send(np.full(3, comm.rank, np.int64), 0)
    return None


def job_p2p_errors(comm):
    errors = []
    for call in (lambda: comm.send(np.zeros(1), comm.rank), lambda: comm.send(np.zeros(1), 7),
                 lambda: comm.send(np.zeros((4, 4))[:, ::2], 1 - comm.rank)):
        try:
            call()
        except CommError as e:
            errors.append(str(e))
    return errors


def job_tags(comm):
    if comm.rank == 1:
        comm.send(np.arange(4.0), 0, tag=5)
        comm.send(np.arange(4.0), 0, tag=6)
        return None
    buf = np.zeros(4)
    try:
        comm.recv(buf, 1, tag=0)
    except CommError as e:
        message = str(e)
    return message, comm.recv(buf, 1, tag=6), buf.tolist()  # the next message still arrives


def job_traced_ring(comm, n):
    comm.tracer.enabled, _ = True, comm.tracer.take()
    try:
        buf = np.full(n, comm.rank, np.float64)
        collectives.allreduce(comm, buf, "ring")
        return [
            (e.kind, e.peer, e.chunk, e.round, e.bytes) for e in comm.tracer.take()
        ], buf.tolist()
    finally:
        comm.tracer.enabled = False


def job_info(comm):
    comm.barrier()
    return comm.rank, comm.world_size, str(comm.device), type(comm.empty(3, "float32")).__name__


def job_train(comm, cfg, sync):
    return train_sync(comm, cfg, sync)


# -- collectives: exact sums, every rank bitwise identical ----------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_is_exact_for_every_dtype_length_and_buffer_kind(world, p, algorithm):
    lengths = sorted({0, 1, p - 1, 7, 13, 101, 1031})
    results = world(p).run(job_allreduce_grid, algorithm, lengths, ("numpy", "cpu"), 7)
    for key, value in results[0].items():
        dtype, n, _ = key
        np.testing.assert_array_equal(value, expected(p, n, dtype, 7), err_msg=str(key))
        assert value.dtype == np.dtype(dtype)
        for rank, other in enumerate(results[1:], 1):
            assert other[key].tobytes() == value.tobytes(), f"rank {rank} differs at {key}"


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(p=st.integers(2, 4), n=st.integers(0, 300), algorithm=st.sampled_from(ALGORITHMS),
       seed=st.integers(0, 2**16))
def test_allreduce_property(world, p, n, algorithm, seed):
    results = world(p).run(job_allreduce_grid, algorithm, [n], ("numpy",), seed)
    for r in results:
        for (dtype, n_, _), value in r.items():
            np.testing.assert_array_equal(value, expected(p, n_, dtype, seed))


@pytest.mark.parametrize("p, n, root", [(2, 9, 1), (3, 2, 0), (4, 17, 3), (4, 0, 2)])
def test_reduce_scatter_allgather_broadcast_reduce(world, p, n, root):
    total = expected(p, n, "int64")
    bounds = chunk_bounds(n, p)
    for rank, res in enumerate(world(p).run(job_collectives, n, "int64", root)):
        a, b = bounds[rank]
        full = np.concatenate([contribution(r, n, "int64")[slice(*bounds[r])] for r in range(p)])
        for alg in ("ring", "direct"):
            np.testing.assert_array_equal(res["rs", alg], total[a:b])
            np.testing.assert_array_equal(res["ag", alg], full)
        for alg in ("tree", "naive"):
            np.testing.assert_array_equal(res["bc", alg], contribution(root, n, "int64"))
            if rank == root:
                np.testing.assert_array_equal(res["rd", alg], total)


# -- point to point -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "cpu"])
@pytest.mark.parametrize(
    "dtype, n",
    [("float64", 10), ("float32", 1), ("int32", 0), ("int64", 4099), ("uint8", 33), ("float16", 7)],
)
def test_send_recv_delivers_the_data_and_names_the_source(world, dtype, n, kind):
    results = world(3).run(job_send_recv, dtype, n, kind)
    assert results[0] is None
    for dst in (1, 2):
        src, data = results[dst]
        assert src == 0 and data.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(data, (np.arange(n) * dst).astype(dtype))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_any_source_receives_every_source_exactly_once(world, p):
    got, *rest = world(p).run(job_any_source)
    assert rest == [None] * (p - 1)
    assert sorted(src for src, _ in got) == list(range(1, p))
    assert all(data == [src] * 3 for src, data in got)


def test_bad_peers_noncontiguous_buffers_and_tag_mismatch_are_comm_errors(world):
    for rank, errors in enumerate(world(2).run(job_p2p_errors)):
        assert len(errors) == 3
        assert f"peer {rank} is not another rank" in errors[0] and "peer 7" in errors[1]
        assert "contiguous" in errors[2]
    message, src, data = world(2).run(job_tags)[0]
    assert "tag 0" in message and "tag 5" in message and (src, data) == (1, [0.0, 1.0, 2.0, 3.0])


def test_ranks_know_their_place_and_trace_their_rounds(world):
    assert world(3).run(job_info) == [(r, 3, "cpu", "ndarray") for r in range(3)]
    p, n = 3, 10
    for rank, (events, values) in enumerate(world(p).run(job_traced_ring, n)):
        assert values == [3.0] * n
        kinds = [e[0] for e in events]
        assert (
            kinds.count("send") == 2 * (p - 1)
            and kinds.count("reduce") == kinds.count("copy") == p - 1
        )
        assert all(peer == (rank + 1) % p for kind, peer, *_ in events if kind == "send")
        assert all(
            peer == (rank - 1) % p for kind, peer, *_ in events if kind in ("reduce", "copy")
        )


# -- failures: fast, clear, and nothing left behind -----------------------------------------

@pytest.mark.parametrize("algorithm, mismatch", [(a, "length") for a in ALGORITHMS]
                         + [("ring", "dtype"), ("ring", "length<p"), ("native", "dtype"),
                            ("tree", "length<p")])
def test_mismatched_buffers_raise_buffer_mismatch_not_a_hang(algorithm, mismatch):
    before = set(mp.active_children())

    def fn(comm):
        n, dtype = (1 if mismatch == "length<p" else 10), "float64"
        if comm.rank == 2:
            n, dtype = {"length": (11, dtype), "dtype": (n, "int64"), "length<p": (2, dtype)}[
                mismatch
            ]
        return collectives.allreduce(comm, np.ones(n, dtype), algorithm=algorithm).tolist()

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 3, backend="torch", timeout=60.0)
    assert time.monotonic() - t0 < 30  # found by check_buffer, not by the 60 s timeout
    assert "BufferMismatch" in str(err.value) and "same length and dtype" in str(err.value)
    assert not set(mp.active_children()) - before  # every rank of the world was reaped


def test_a_rank_that_raises_fails_launch_fast_naming_it():
    before = set(mp.active_children())

    def fn(comm):
        if comm.rank == 2:
            raise ValueError("the original message from rank 2")
        comm.recv(np.zeros(1), 2)  # blocked until the launcher stops us

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 4, backend="torch", timeout=60.0)
    assert time.monotonic() - t0 < 30  # not the survivors' 60 s timeout (start included)
    assert err.value.rank == 2 and "the original message from rank 2" in str(err.value)
    assert "ValueError" in str(err.value) and "Traceback" in err.value.detail
    assert not set(mp.active_children()) - before  # every rank of the world was reaped


def test_a_rank_killed_by_sigkill_fails_launch_fast():
    before = set(mp.active_children())

    def fn(comm):
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.recv(np.zeros(1), 1)

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 3, backend="torch", timeout=60.0)
    assert time.monotonic() - t0 < 30  # not the survivors' 60 s timeout (start included)
    # The launcher sees the death, or a peer's lost connection first: either names rank 1.
    assert (err.value.rank == 1 and "SIGKILL" in str(err.value)) or "lost rank 1" in str(err.value)
    assert not set(mp.active_children()) - before  # every rank of the world was reaped


def test_a_direct_exchange_of_mismatched_shapes_times_out_instead_of_killing_gloo():
    """Collectives check shapes once (check_buffer); a bare exchange has no header, but its
    messages travel under their shape's tag: a longer one never meets the receive, so no abort."""
    before = set(mp.active_children())

    def fn(comm):
        if comm.rank == 0:
            comm.exchange([], [RecvSpec(np.zeros(4), 1)])
        else:
            comm.exchange([SendSpec(np.zeros(5), 0)], [])

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 2, backend="torch", timeout=2.0)
    assert 1.9 < time.monotonic() - t0 < 60  # its 2 s timeout, then an end (loose: load)
    assert "CommTimeout" in str(err.value) and "round -1" in str(err.value)
    assert not set(mp.active_children()) - before


def job_in_pieces(comm, n, dtype):
    import dplab.backends.torchdist.comm as td

    td.PIECE_BYTES, before = 24, td.PIECE_BYTES  # 3 float64 or 6 float32 per piece: many pieces
    try:
        out = {}
        for algorithm in ("ring", "tree", "direct", "naive"):
            buf = contribution(comm.rank, n, dtype)
            out[algorithm] = collectives.allreduce(comm, buf, algorithm=algorithm).tolist()
        return out
    finally:
        td.PIECE_BYTES = before


@pytest.mark.parametrize("n, dtype", [(101, "float64"), (1000, "float32"), (7, "int64")])
def test_messages_cut_into_pieces_still_sum_exactly(world, n, dtype):
    for got in world(3).run(job_in_pieces, n, dtype):
        for algorithm, values in got.items():
            np.testing.assert_array_equal(values, expected(3, n, dtype), err_msg=algorithm)


def job_no_receive_left_posted(comm):
    for algorithm in ("ring", "tree", "direct", "naive"):
        collectives.allreduce(comm, np.ones(1000), algorithm=algorithm)
    collectives.reduce_scatter(comm, np.ones(1000))
    collectives.allgather(comm, np.ones(1000))
    return dict(comm._early)


def test_receives_posted_a_round_early_are_all_taken_by_their_round(world):
    assert world(4).run(job_no_receive_left_posted) == [{}] * 4


def test_recv_from_a_silent_peer_times_out_with_a_clear_message():
    def fn(comm):
        if comm.rank == 0:
            comm.recv(np.zeros(2), 1)

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 2, backend="torch", timeout=2.0)
    assert 1.9 < time.monotonic() - t0 < 60  # its 2 s timeout, then an end (loose: load)
    assert err.value.rank == 0 and "CommTimeout" in str(err.value)
    assert "rank 0 waited 2s for rank 1" in str(err.value)


def test_worlds_come_and_go_in_one_process():
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    before = set(mp.active_children())
    for i in range(6):
        with World(2, backend="torch", timeout=10.0) as w:
            assert w.run(job_info)[1][:2] == (1, 2)
        assert launch(lambda comm, i=i: comm.rank + i, 2, backend="torch") == [i, i + 1]
    assert not set(mp.active_children()) - before  # every rank of the world was reaped
    if fds:
        assert len(os.listdir("/proc/self/fd")) <= fds + 2  # no socket kept per world


def test_cuda_without_enough_gpus_is_a_config_error(monkeypatch):
    p = torch.cuda.device_count() + 1
    monkeypatch.setenv("DPLAB_DEVICE", "cuda")
    with pytest.raises(ConfigError, match=f"{p} ranks need {p} GPUs.*--device cpu"):
        World(p, backend="torch")
    monkeypatch.setenv("DPLAB_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="'cpu'.*'cuda'"):
        World(2, backend="torch")


# -- data parallel training over torch == one device ----------------------------------------

TRAIN = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=60,
                    global_batch=11, steps=4, seed=5)


@pytest.mark.parametrize(
    "p, algorithm, accum_steps, global_batch",
    [
        (2, "ring", 1, 11),
        (3, "tree", 2, 11),
        (4, "native", 1, 3),
        (4, "direct", 2, 9),
        (3, "naive", 1, 16),
    ],
)
def test_train_sync_equals_train_single(world, p, algorithm, accum_steps, global_batch):
    cfg = dataclasses.replace(TRAIN, global_batch=global_batch)
    results = world(p).run(
        job_train, cfg, SyncConfig(algorithm, bucket_cap_mb=1e-4, accum_steps=accum_steps)
    )
    ref = train_single(cfg).params
    assert np.max(np.abs(results[0].params - ref)) <= 1e-10 * max(1.0, np.max(np.abs(ref)))
    assert all(np.array_equal(r.params, results[0].params) for r in results)


def test_torchrun_runs_the_cli_on_its_own_ranks(tmp_path):
    """As a user types it: ``torchrun --nproc-per-node 2 -m dplab.backends.cli train --backend
    torch``. Two ranks: what is checked is torchrun's hand-off (its ranks find their world, rank 0
    alone prints); the engine at p = 3, 4 is the worlds' tests (each rank here is a fresh
    interpreter importing torch, ~3 CPU-s)."""
    out = tmp_path / "run.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "dplab.backends.cli",
        "train",
        "--backend",
        "torch",
        "--steps",
        "5",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["world_size"] == 2 and rows[0]["backend"] == "torch"
    assert rows[0]["max_abs_diff_vs_single"] < 1e-12 and rows[0]["ranks_identical"]
    assert proc.stdout.count("max_abs_diff_vs_single") == 1  # one table, printed by rank 0


# -- NCCL on GPUs ---------------------------------------------------------------------------

def job_cuda(comm, cfg):
    out = {"device": str(comm.device)}
    for algorithm in ALGORITHMS:
        for n in (0, 1, comm.world_size - 1, 13, 1031):
            buf = as_kind(contribution(comm.rank, n, "float32"), "device", comm)
            collectives.allreduce(comm, buf, algorithm)
            out[algorithm, n] = (buf.device.type, to_numpy(buf))
    out["train"] = train_sync(comm, cfg, SyncConfig("ring", 1e-4, 2)).params
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 2, 4])
def test_nccl_on_cuda_tensors_is_exact_and_trains_like_one_device(monkeypatch, p):
    if torch.cuda.device_count() < p:
        pytest.skip(f"needs {p} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    monkeypatch.setenv("DPLAB_DEVICE", "cuda")
    with World(p, backend="torch", timeout=60.0) as w:
        results = w.run(job_cuda, TRAIN)
    ref = train_single(TRAIN).params
    for rank, res in enumerate(results):
        assert res["device"] == f"cuda:{rank}"
        for algorithm in ALGORITHMS:
            for n in (0, 1, p - 1, 13, 1031):
                device, value = res[algorithm, n]
                assert device == "cuda"
                np.testing.assert_array_equal(value, expected(p, n, "float32"))
        assert np.max(np.abs(res["train"] - ref)) <= 1e-10 * max(1.0, np.max(np.abs(ref)))
