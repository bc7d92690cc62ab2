"""The cuda backend (ranks as threads, each on its own CUDA stream) against the local backend.

Every collective and algorithm gives the same bits as the local backend running the same schedule
(integers and float64 exactly; float32 too, as one add of two numbers rounds the same everywhere),
mismatches and failures are named as on every backend, and the torch wrappers and the trainer run
on it. Each test runs with the ranks' tensors on the CPU (the transport's threads, inboxes and
mismatch checks: here, on every machine) and on the GPU (streams and events: marker ``gpu``,
skipped without one).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dplab.backends import registry  # noqa: E402
from dplab.backends.cuda import setup  # noqa: E402
from dplab.backends.launch.world import RankError, World, launch  # noqa: E402
from dplab.reference import collectives  # noqa: E402
from dplab.reference.algorithms import ALGORITHMS, ROOTED, SCATTER  # noqa: E402

pytestmark = pytest.mark.torch
TIMEOUT = 20.0


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch) -> str:
    """Where the ranks' tensors live; "cpu" puts the cuda backend's ranks on the CPU."""
    if request.param == "cuda":
        if not torch.cuda.device_count():  # NVML: starts no CUDA in this (forking) process
            pytest.skip("needs a CUDA GPU, this machine has none")
        return "cuda"
    monkeypatch.setitem(registry.BACKENDS, "cuda",
                        dataclasses.replace(registry.BACKENDS["cuda"], available=lambda: None))
    monkeypatch.setattr(setup, "_DEVICE_OF", lambda rank: torch.device("cpu"))
    return "cpu"


def _inputs(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _call(comm, kind: str, algorithm: str, root: int, buf):
    if kind == "allreduce" and algorithm == "native":
        comm.native_allreduce(buf.reshape(-1) if isinstance(buf, np.ndarray) else buf.view(-1))
    elif kind in ("broadcast", "reduce"):
        getattr(collectives, kind)(comm, buf, root=root, algorithm=algorithm)
    else:
        getattr(collectives, kind)(comm, buf, algorithm=algorithm)


def job_collective(comm, kind: str, algorithm: str, root: int, n: int, dtype: str, on_device: bool):
    x = _inputs(comm.rank, n, dtype)
    buf = torch.from_numpy(x).to(comm.device) if on_device else x
    _call(comm, kind, algorithm, root, buf)
    return buf.cpu().numpy() if on_device else buf


def _calls() -> list[tuple[str, str, int]]:
    calls = [("allreduce", a, 0) for a in ALGORITHMS]
    calls += [(k, a, 0) for a in SCATTER for k in ("reduce_scatter", "allgather")]
    calls += [(k, a, r) for a in ROOTED for k in ("broadcast", "reduce") for r in (0, 2)]
    return calls


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_every_collective_gives_the_local_backends_bits(worlds, device, p):
    n = 1001  # not a multiple of any p: uneven chunks
    with World(p, "cuda", timeout=TIMEOUT) as world:
        for kind, algorithm, root in _calls():
            root = root % p
            for dtype in ("int64", "float64", "float32"):
                want = worlds(p).run(job_collective, kind, algorithm, root, n, dtype, False)
                for on_device in (True, False):
                    got = world.run(job_collective, kind, algorithm, root, n, dtype, on_device)
                    for r in range(p):
                        if kind == "reduce" and r != root:
                            continue  # other ranks hold partial sums: scratch
                        assert got[r].tobytes() == want[r].tobytes(), (
                            kind,
                            algorithm,
                            root,
                            dtype,
                            r,
                        )


def job_mismatch(comm, mine: str, theirs: str, n: int):
    kind, algorithm, root = (mine if comm.rank == 0 else theirs).split(":")
    buf = torch.ones(n, dtype=torch.float64, device=comm.device)
    _call(comm, kind, algorithm, int(root or 0), buf)


@pytest.mark.parametrize("mine,theirs,named", [
    ("allreduce:ring:", "allreduce:tree:", "allreduce(tree)"),
    ("allreduce:ring:", "allreduce:native:", "allreduce(native)"),
    ("broadcast:tree:0", "reduce:tree:0", "reduce(tree, root=0)"),  # both ranks only send
])
def test_a_mismatched_collective_is_named_at_once(device, mine, theirs, named):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_mismatch, 2, backend="cuda", args=(mine, theirs, 1 << 16), timeout=TIMEOUT)
    assert "CollectiveMismatch" in str(err.value) and named in str(err.value), str(err.value)
    assert time.monotonic() - t0 < 8


def job_lengths(comm, algorithm: str):
    buf = torch.ones(100 + comm.rank, device=comm.device)
    _call(comm, "allreduce", algorithm, 0, buf)


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_a_mismatched_buffer_is_named(device, algorithm):
    with pytest.raises(RankError) as err:
        launch(job_lengths, 2, backend="cuda", args=(algorithm,), timeout=TIMEOUT)
    assert "BufferMismatch" in str(err.value) and "100 x float32" in str(err.value), str(err.value)


def job_fails(comm):
    if comm.rank == 1:
        raise ValueError("rank 1 gives up")
    collectives.allreduce(comm, torch.ones(10, device=comm.device))


def test_a_failing_rank_is_reported_and_its_peers_do_not_hang(device):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_fails, 3, backend="cuda", timeout=TIMEOUT)
    assert err.value.rank == 1 and "rank 1 gives up" in str(err.value)
    assert time.monotonic() - t0 < 8


def job_waits(comm):
    if comm.rank == 0:
        collectives.allreduce(comm, torch.ones(10, device=comm.device))


def test_a_rank_left_waiting_times_out_naming_its_peer(device):
    with pytest.raises(RankError) as err:
        launch(job_waits, 2, backend="cuda", timeout=1.0)
    assert "CommTimeout" in str(err.value) and "from rank 1" in str(err.value), str(err.value)


def job_train(comm):
    from dplab.reference.train.single import TrainConfig
    from dplab.reference.train.sync import SyncConfig, train_sync

    return train_sync(comm, TrainConfig(steps=5), SyncConfig("ring", bucket_cap_mb=0.001)).params


def test_the_trainer_on_cuda_equals_one_device(device):
    from dplab.reference.train.single import TrainConfig, train_single

    want = train_single(TrainConfig(steps=5)).params
    got = launch(job_train, 4, backend="cuda", timeout=60)
    assert all(g.tobytes() == got[0].tobytes() for g in got)
    assert np.max(np.abs(got[0] - want)) < 1e-12


def _net():
    from torch import nn

    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def _batch(g, n: int) -> tuple:
    return torch.randn(n, 16, generator=g).double(), torch.randn(n, 4, generator=g).double()


def _start_weights() -> dict[str, np.ndarray]:
    """Drawn here with NumPy and sent: ranks that are threads share torch's one global generator
    (a ``torch.manual_seed`` in each would race with the others' draws), and ``torch.manual_seed``
    here would start CUDA in this process, which a forked cuda world cannot survive."""
    rng = np.random.default_rng(0)
    return {k: rng.uniform(-0.3, 0.3, tuple(v.shape)) for k, v in _net().state_dict().items()}


def job_wrapper(comm, wrapper: str, weights: dict):
    from dplab.backends.nn.ddp import DistributedDataParallel
    from dplab.backends.nn.fsdp import FSDP
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    model = _net()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    model = model.to(comm.device)
    if wrapper == "ddp":
        net, opt = DistributedDataParallel(model, comm), None
    elif wrapper == "zero":
        net = model
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, comm, lr=0.1, momentum=0.9
        )
    else:
        net, opt = FSDP(model, comm, units=[model[0], model[2]]), None
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = _batch(g, 8 * comm.world_size)
        mine = slice(8 * comm.rank, 8 * comm.rank + 8)
        opt.zero_grad()
        ((net(x[mine].to(comm.device)) - y[mine].to(comm.device)) ** 2).mean().backward()
        opt.step()
    params = net.full_state_dict() if wrapper == "fsdp" else model.state_dict()
    return {k: v.detach().cpu().numpy() for k, v in params.items()}


def _one_process(world_size: int) -> dict[str, np.ndarray]:
    model = _net()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in _start_weights().items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = _batch(g, 8 * world_size)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def job_first_forward_after_a_collective(comm):
    net = _net().to(comm.device)
    x = torch.ones(8, 16, dtype=torch.float64, device=comm.device)
    collectives.allgather(comm, np.zeros(1000), algorithm="ring")  # the ranks leave it at once
    net(x).sum().backward()  # each thread's first autograd call in this forked process
    return True


def test_rank_threads_whose_first_forward_comes_at_once_do_not_crash(device):
    """Torch rebuilds its autograd engine on the first autograd call after a fork, without a lock.
    Rank threads whose first forward came right after one collective rebuilt it together, and the
    process died of SIGSEGV, until the rank process rebuilt it itself before starting its threads.
    Each world is a fresh fork. Whether a double rebuild crashes depends on how the heap of the
    process that forks lies, so a run can miss the race: this test catches a regression often,
    not always."""
    _one_process(4)  # this process has run a backward and an optimizer step before forking
    for _ in range(40):
        assert launch(job_first_forward_after_a_collective, 4, backend="cuda",
                      timeout=TIMEOUT) == [True] * 4


@pytest.mark.parametrize("wrapper", ["ddp", "zero", "fsdp"])
def test_the_torch_wrappers_on_cuda_train_like_one_process(device, wrapper):
    want = _one_process(4)
    got = launch(job_wrapper, 4, backend="cuda", args=(wrapper, _start_weights()), timeout=60)
    for params in got:
        for k, v in want.items():
            assert np.max(np.abs(params[k] - v)) < 1e-12, (wrapper, k)
