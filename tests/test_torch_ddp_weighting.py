"""DDP's torch conventions: ``bucket_cap_mb=None``, and uneven shards weighted exactly.

torch's DDP averages gradients over ranks (sum / p), which is the full batch's gradient only
for equal shards. ``DDP(..., local_batch_size=n)`` weights each rank's mean gradient by
n_r / N instead; these tests train on uneven shards (one of them empty) and compare with one
process on the whole batch, float64, relative 1e-10 after every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from strategies import one_at_a_time, seed_torch  # noqa: E402
from tiers import engines  # noqa: E402
from torch import nn  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo once, before forks

F64, SEED, STEPS = torch.float64, 7, 3


@one_at_a_time
def make_model(seed: int) -> nn.Module:
    seed_torch(seed)
    return nn.Sequential(nn.Linear(4, 6, dtype=F64), nn.Tanh(), nn.Linear(6, 2, dtype=F64))


def batch(step: int, n: int) -> tuple:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(n, 4, generator=g, dtype=F64), torch.randn(n, 2, generator=g, dtype=F64)


def snapshot(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def reference(n: int) -> list[list[np.ndarray]]:
    """One process, the whole global batch of ``n``, mean loss: parameters after each step."""
    model = make_model(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = [snapshot(model)]
    for step in range(STEPS):
        x, y = batch(step, n)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        snaps.append(snapshot(model))
    return snaps


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


# -- rank functions (module level: persistent worlds pickle them) -----------------------------

def _train_uneven(comm, n: int, exact: bool, algorithm: str = "ring") -> list:
    """This rank trains on its ``chunk_bounds`` shard of a global batch of ``n`` (mean loss)."""
    from dplab.backends.nn.ddp import DDP

    torch.set_num_threads(1)
    lo, hi = chunk_bounds(n, comm.world_size)[comm.rank]
    model = make_model(SEED + comm.rank)  # rank 0's after the broadcast
    ddp = DDP(model, comm, bucket_cap_mb=1e-9, algorithm=algorithm,
              local_batch_size=hi - lo if exact else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    snaps = [snapshot(model)]
    for step in range(STEPS):
        x, y = batch(step, n)
        opt.zero_grad()
        ((ddp(x[lo:hi]) - y[lo:hi]) ** 2).mean().backward()  # an empty shard: NaN, weighted 0
        opt.step()
        snaps.append(snapshot(model))
    ddp.close()
    return snaps


def _changing_shards(comm) -> list:
    """The shard sizes change between steps: set_local_batch_size follows them."""
    from dplab.backends.nn.ddp import DDP

    model = make_model(SEED)
    ddp = DDP(model, comm, local_batch_size=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = []
    for n in (5, 9):
        lo, hi = chunk_bounds(n, comm.world_size)[comm.rank]
        ddp.set_local_batch_size(hi - lo)
        x, y = batch(0, n)
        opt.zero_grad()
        ((ddp(x[lo:hi]) - y[lo:hi]) ** 2).mean().backward()
        out.append((ddp.global_batch_size, [p.grad.numpy().copy() for p in model.parameters()]))
    ddp.close()
    return out


def _bad_local_batch(comm) -> str:
    from dplab.backends.nn.ddp import DDP

    try:
        DDP(make_model(SEED), comm, local_batch_size=-1 if comm.rank == 0 else 3)
    except ConfigError as e:
        return str(e)
    return "no error"


def _buckets(comm, cap) -> int:
    from dplab.backends.nn.ddp import DDP

    torch.manual_seed(0)  # 5 layers of 1024 x 1024 float64: 8 MiB of gradient each
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False, dtype=F64) for _ in range(5)))
    ddp = DDP(model, comm) if cap == "omitted" else DDP(model, comm, bucket_cap_mb=cap)
    count = len(ddp.reducer.buckets)
    ddp.close()
    return count


# -- tests -----------------------------------------------------------------------------------

def test_bucket_cap_none_is_torchs_default_and_inf_is_one_bucket(worlds):
    """torch.nn.parallel.DistributedDataParallel: "If None, a default size of 25 MiB will be
    used"."""
    world = worlds(1)
    at_25 = world.run(_buckets, 25.0)[0]
    assert at_25 == 2  # 8 + 8 + 8 + 8 MiB close the first bucket at >= 25 MiB; one layer is left
    assert world.run(_buckets, None)[0] == at_25
    assert world.run(_buckets, "omitted")[0] == at_25
    assert world.run(_buckets, math.inf)[0] == 1


# (3, 2): rank 2's shard is empty
@pytest.mark.parametrize("backend, p, n", engines([(2, 7), (3, 7), (3, 2), (4, 10)]),
                         indirect=["backend"])
def test_uneven_shards_with_local_batch_size_equal_the_full_batch(worlds, backend, p, n):
    ref = reference(n)
    results = worlds(p, backend).run(_train_uneven, n, True)
    for rank, snaps in enumerate(results):
        for step, (mine, theirs) in enumerate(zip(snaps, ref)):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                assert rel(a, b) <= 1e-10, f"rank {rank} step {step} param {i}: {rel(a, b):.3g}"
            assert all(np.array_equal(a, b) for a, b in zip(mine, results[0][step]))


def test_without_local_batch_size_uneven_shards_are_weighted_by_rank_not_by_sample(worlds):
    """The documented default (torch's): 7 samples on 2 ranks as 4 + 3 are not the full batch."""
    ref = reference(7)
    snaps = worlds(2).run(_train_uneven, 7, False)[0]
    assert rel(snaps[1][0], ref[1][0]) > 1e-4


def test_set_local_batch_size_follows_changing_shards(worlds):
    p = 3
    for n, (total, grads) in zip((5, 9), worlds(p).run(_changing_shards)[0]):
        model = make_model(SEED)
        x, y = batch(0, n)
        ((model(x) - y) ** 2).mean().backward()
        assert total == n
        for g, q in zip(grads, model.parameters()):
            assert rel(g, q.grad.numpy()) <= 1e-12


def test_a_bad_local_batch_size_raises_on_every_rank(worlds):
    for message in worlds(2).run(_bad_local_batch):
        assert "local_batch_size must be an integer >= 0" in message
