"""The reference recipe on torch tensors: what it computes on a GPU, checked here on the CPU.

Where the communicator's buffers live on a CUDA device, ``train_sync`` computes there with torch
tensors (``compute_device``); the model and optimizers run the same lines on numpy arrays and torch
tensors (``array_namespace``). ``device=torch.device("cpu")`` runs that torch path on the CPU, so it
is checked on every machine: in float64 it ends within 1e-12 (relative) of the NumPy path, on the
cuda backend's ranks put on the CPU (as ``tests/test_cuda_backend.py`` does). On a GPU (marker
``gpu``) the recipe picks the GPU by itself and ends within rounding of one device.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dplab.backends import registry  # noqa: E402
from dplab.backends.cuda import setup as cuda_setup  # noqa: E402
from dplab.backends.launch.world import RankError, World  # noqa: E402
from dplab.reference.model import MLP, MLPConfig, array_namespace  # noqa: E402
from dplab.reference.optim import OPTIMIZERS, OptimConfig, make_optimizer  # noqa: E402
from dplab.reference.precision.config import MixedPrecision  # noqa: E402
from dplab.reference.train.single import TrainConfig, train_single  # noqa: E402
from dplab.reference.train.sync import SyncConfig, compute_device, train_sync  # noqa: E402

pytestmark = pytest.mark.torch
CPU = torch.device("cpu")
NETS = [("mse", "tanh"), ("mse", "relu"), ("xent", "tanh"), ("xent", "relu")]


def _cfg(loss: str, activation: str, optimizer: str, dtype: str = "float64") -> TrainConfig:
    return TrainConfig(model=MLPConfig(activation=activation, loss=loss), steps=6, dtype=dtype,
                       dataset="regression" if loss == "mse" else "classification",
                       optimizer=OptimConfig(optimizer, lr=5.0 if optimizer == "lars" else 0.05,
                                             weight_decay=0.01))


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture
def cuda_on_cpu(monkeypatch) -> None:
    """The cuda backend's ranks on the CPU: threads of one process, torch tensors on the CPU."""
    monkeypatch.setitem(registry.BACKENDS, "cuda",
                        dataclasses.replace(registry.BACKENDS["cuda"], available=lambda: None))
    monkeypatch.setattr(cuda_setup, "_DEVICE_OF", lambda rank: CPU)


def test_array_namespace_is_read_off_the_arrays_type():
    assert array_namespace(np.zeros(2)) is np
    assert array_namespace(torch.zeros(2)) is torch
    assert array_namespace(torch.nn.Parameter(torch.zeros(2))) is torch


def test_the_recipe_computes_on_the_communicators_cuda_device_only():
    gpu, sync = torch.device("cuda", 0), SyncConfig()  # a device object only: no CUDA starts
    assert compute_device(SimpleNamespace(device=gpu), sync) == gpu
    # the cuda backend on the CPU, gloo
    assert compute_device(SimpleNamespace(device=CPU), sync) is None
    assert compute_device(SimpleNamespace(), sync) is None  # local, mpi: numpy arrays
    assert compute_device(SimpleNamespace(), sync, CPU) == CPU  # asked for: torch on the CPU


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("loss,activation", NETS)
def test_one_device_on_torch_equals_numpy(loss, activation, optimizer):
    cfg = _cfg(loss, activation, optimizer)
    want, got = train_single(cfg), train_single(cfg, device=CPU)
    assert type(got.params) is np.ndarray and got.params.dtype == np.float64
    assert _relative(got.params, want.params) < 1e-12
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-12)


def test_float32_on_torch_is_float32_and_close():
    cfg = _cfg("mse", "tanh", "adam", dtype="float32")
    want, got = train_single(cfg), train_single(cfg, device=CPU)
    assert got.params.dtype == np.float32
    assert _relative(got.params, want.params) < 1e-5


def test_model_and_optimizer_keep_torch_tensors_where_they_are():
    model = MLP(MLPConfig(in_dim=3, hidden=(5,), out_dim=2, loss="xent"))
    params = torch.from_numpy(model.init_params(seed=0))
    x, y = torch.ones(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    loss, grad = model.loss_and_grad(params, x, y, scale=1 / 4)
    assert (
        isinstance(loss, float) and isinstance(grad, torch.Tensor) and grad.dtype == torch.float64
    )
    want_loss, want_grad = model.loss_and_grad(
        params.numpy().copy(), x.numpy(), y.numpy(), scale=1 / 4
    )
    assert loss == pytest.approx(want_loss, rel=1e-14)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-13, atol=1e-16)
    opt = make_optimizer(OptimConfig("adam"), model.num_params, params.dtype, device=CPU)
    opt.step(params, grad)
    assert isinstance(opt.exp_avg, torch.Tensor) and opt.t == 1
    with pytest.raises(Exception, match="xent targets must be integer labels"):
        model.loss(model.forward(params, x), y.double(), 1.0)


def job_train(comm, cfg: TrainConfig, sync: SyncConfig, on_torch: bool):
    result = train_sync(comm, cfg, sync, device=CPU if on_torch else None)
    return result.params, result.losses


@pytest.mark.parametrize("p", [1, 2, 4])
def test_sync_on_torch_equals_the_numpy_path_on_the_cuda_backend(cuda_on_cpu, p):
    # several buckets, two micro-batches
    sync = SyncConfig("ring", bucket_cap_mb=0.001, accum_steps=2)
    with World(p, "cuda", timeout=60) as world:
        for loss, activation in NETS:
            for optimizer in ("sgd", "momentum", "adam"):
                cfg = _cfg(loss, activation, optimizer)
                want = world.run(job_train, cfg, sync, False)
                got = world.run(job_train, cfg, sync, True)
                assert all(type(params) is np.ndarray for params, _ in got)
                # replicas equal
                assert all(params.tobytes() == got[0][0].tobytes() for params, _ in got)
                assert _relative(got[0][0], want[0][0]) < 1e-12, (loss, activation, optimizer)
                np.testing.assert_allclose(got[0][1], want[0][1], rtol=1e-12)


@pytest.mark.parametrize("p, global_batch, accum_steps", [(5, 3, 1), (4, 2, 3), (8, 1, 4)])
def test_empty_shards_and_micro_batches_on_torch(cuda_on_cpu, p, global_batch, accum_steps):
    sync = SyncConfig("ring", bucket_cap_mb=1e-6, accum_steps=accum_steps)
    with World(p, "cuda", timeout=60) as world:
        for loss, activation in (("mse", "tanh"), ("xent", "relu")):
            cfg = dataclasses.replace(_cfg(loss, activation, "momentum"), global_batch=global_batch)
            got = world.run(job_train, cfg, sync, True)
            assert all(params.tobytes() == got[0][0].tobytes() for params, _ in got)
            assert _relative(got[0][0], train_single(cfg).params) < 1e-12


def job_refused(comm, sync: SyncConfig):
    train_sync(comm, TrainConfig(steps=1, dtype="float32"), sync, device=CPU)


def test_checkpoints_and_mixed_precision_are_refused_on_torch():
    with World(1, "local", timeout=30) as world:
        with pytest.raises(RankError, match="checkpoints and mixed precision work on NumPy"):
            world.run(job_refused, SyncConfig(precision=MixedPrecision()))


def test_a_run_on_the_gpu_refuses_checkpoints_and_mixed_precision_before_any_rank(monkeypatch):
    from dplab.backends.runs.run import RunSpec
    from dplab.reference.checkpoint.resume import CheckpointConfig

    monkeypatch.setenv("DPLAB_DEVICE", "cuda")
    assert RunSpec(backend="torch").on_gpu() and RunSpec(backend="cuda").on_gpu()
    assert not RunSpec(backend="local").on_gpu() and not RunSpec(backend="mpi").on_gpu()
    with pytest.raises(Exception, match="checkpoints and mixed precision work on NumPy"):
        RunSpec(backend="torch", checkpoint=CheckpointConfig(2, "ckpt")).check_gpu()
    RunSpec(backend="torch").check_gpu()  # nothing NumPy's asked for: fine
    monkeypatch.setenv("DPLAB_DEVICE", "cpu")
    assert not RunSpec(backend="torch").on_gpu()  # gloo: NumPy on the host


def job_on_gpu(comm, cfg: TrainConfig):
    params = train_sync(comm, cfg, SyncConfig("ring", bucket_cap_mb=0.001)).params
    return params, torch.cuda.max_memory_allocated(comm.device)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 2, 4])
def test_sync_on_a_gpu_computes_there_and_equals_one_device(p):
    if not torch.cuda.device_count():  # NVML: starts no CUDA in this (forking) process
        pytest.skip("needs a CUDA GPU, this machine has none")
    for loss, activation in NETS:
        cfg = _cfg(loss, activation, "adam")
        want = train_single(cfg).params  # NumPy, on the host
        with World(p, "cuda", timeout=120) as world:
            got = world.run(job_on_gpu, cfg)
        # the parameters, data and gradients were on the GPU
        assert all(used > 0 for _, used in got)
        assert all(params.tobytes() == got[0][0].tobytes() for params, _ in got)
        assert _relative(got[0][0], want) < 1e-10
