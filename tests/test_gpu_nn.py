"""The torch wrappers on a CUDA device, one rank (NCCL): what a one-GPU machine can check.

DDP, ZeRO-1 and FSDP (with a bf16 ``compute_dtype``) keep their tensors on the GPU and train like
one process on the same device. Multi-rank NCCL needs several GPUs; these run with one. Marker
``gpu``; without CUDA they skip and say so.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from dplab.backends.launch.world import World  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.torch]
STEPS, B = 3, 16


def _model(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4)).to(device)


def _batches(device):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, 32, generator=g).to(device), torch.randn(B, 4, generator=g).to(device))
            for _ in range(STEPS)]


def _reference(device, dtype=None) -> list[np.ndarray]:
    """One process on ``device``; with ``dtype`` a low-precision copy computes each gradient."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(device):
        opt.zero_grad()
        if dtype is None:
            ((model(x) - y) ** 2).mean().backward()
        else:
            low = copy.deepcopy(model).to(dtype)
            ((low(x.to(dtype)).float() - y) ** 2).mean().backward()
            for m, q in zip(model.parameters(), low.parameters()):
                m.grad = q.grad.float()
        opt.step()
    return [p.detach().cpu().double().numpy() for p in model.parameters()]


def job(comm, wrapper: str):
    from dplab.backends.nn.ddp import DistributedDataParallel
    from dplab.backends.nn.fsdp import FSDP
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    device = comm.device
    model = _model(device)
    if wrapper == "ddp":
        net = DistributedDataParallel(model, comm)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    elif wrapper == "zero":
        net = model
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, comm, lr=0.1, momentum=0.9
        )
    else:
        net = FSDP(model, comm, units=[model[0], model[2]], compute_dtype=torch.bfloat16)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    devices = set()
    for x, y in _batches(device):
        opt.zero_grad()
        out = net(x)
        devices |= {str(out.device)} | {str(p.device) for p in net.parameters()}
        ((out.float() - y) ** 2).mean().backward()
        opt.step()
    if wrapper == "fsdp":
        state = net.full_state_dict()
        order = [f"{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")]
        params = [state[k] for k in order]
    else:
        params = list(model.parameters())
    got = [p.detach().cpu().double().numpy() for p in params]
    # the references run here: the test process must not touch CUDA
    dtype = torch.bfloat16 if wrapper == "fsdp" else None
    return got, sorted(devices), _reference(device, dtype), _reference(device)


@pytest.mark.parametrize("wrapper", ["ddp", "zero", "fsdp"])
def test_wrappers_on_one_gpu_train_like_one_process(monkeypatch, wrapper):
    if torch.cuda.device_count() < 1:  # NVML: does not start CUDA in this (forking) process
        pytest.skip("needs a CUDA GPU, this machine has none")
    monkeypatch.setenv("DPLAB_DEVICE", "cuda")
    with World(1, backend="torch", timeout=60.0) as w:
        # (forked ranks: CUDA only ever starts there)
        (params, devices, ref, plain), = w.run(job, wrapper)
    assert devices == ["cuda:0"]  # activations and parameters never left the GPU
    err = max(np.max(np.abs(a - b)) for a, b in zip(params, ref))
    # bf16: the same casts, other kernel order
    assert err <= (1e-3 if wrapper == "fsdp" else 1e-6), err
    if wrapper == "fsdp":  # and the casts mattered: far from plain fp32 training
        assert max(np.max(np.abs(a - b)) for a, b in zip(params, plain)) > 10 * err
