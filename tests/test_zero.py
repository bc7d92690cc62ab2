"""ZeRO stage 1 == the unsharded optimizer on the averaged gradient, with 1/p of its state.

Each rank trains a plain module (no DDP wrapper) on its shard of the global batch and
steps a ``ZeroRedundancyOptimizer``; the reference is one process with the torch optimizer
over every parameter, on the whole batch. Parameters must agree within relative 1e-10
(float64) after every step and be bitwise identical across ranks; each rank's optimizer
state must be its shard's share, n/p elements up to the chunking remainder, also when
n is not divisible by p and when n < p (some shards are empty).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from tiers import engines

torch = pytest.importorskip("torch")
from strategies import one_at_a_time, seed_torch  # noqa: E402
from torch import nn  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo once, before forks

B, STEPS, SEED, F64 = 24, 4, 100, torch.float64
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}
PER_ELEMENT = {"adamw": 2 * 8, "sgd": 8}  # float64 bytes of state per parameter element
PER_TENSOR = {"adamw": 4, "sgd": 0}  # AdamW's step counter: a float32 scalar per tensor
SHAPES = {"mlp": (5, 7, 3), "tiny": (2, 1), "wide": (64, 64, 8)}  # trainable n: 63, 2, 4680


@one_at_a_time
def make_model(kind: str, seed: int) -> nn.Module:
    """An MLP of SHAPES[kind]; in "mlp" the last bias is frozen (it must not move)."""
    seed_torch(seed)
    dims = SHAPES[kind]
    layers = [nn.Linear(a, b, bias=kind != "tiny", dtype=F64) for a, b in zip(dims[:-1], dims[1:])]
    if kind == "mlp":
        layers[-1].bias.requires_grad_(False)
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def batch(kind: str, step: int) -> tuple:
    g = torch.Generator().manual_seed(2000 + step)
    dims = SHAPES[kind]
    return torch.randn(B, dims[0], generator=g, dtype=F64), torch.randn(
        B, dims[-1], generator=g, dtype=F64
    )


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def snapshot(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


@cache
def reference(kind: str, opt_name: str, steps: int = STEPS) -> tuple[list, int]:
    """One process, the whole batch, the torch optimizer over every parameter."""
    model = make_model(kind, SEED)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kwargs)
    snaps = [snapshot(model)]
    for step in range(steps):
        x, y = batch(kind, step)
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().div(B).backward()
        opt.step()
        snaps.append(snapshot(model))
    return snaps, state_bytes(opt)


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


# -- rank functions (module level: MPI ranks unpickle them) ----------------------------------

def _train_zero(comm, kind: str, opt_name: str, steps: int = STEPS) -> dict:
    from dplab.backends.nn.ddp import broadcast_module
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    model = make_model(kind, SEED + comm.rank)  # differs per rank until the broadcast
    broadcast_module(model, comm)
    staged = getattr(comm, "bytes_staged", 0)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = ZeroRedundancyOptimizer(model.parameters(), cls, comm, **kwargs)
    per_rank = B // comm.world_size
    lo = comm.rank * per_rank
    snaps = [snapshot(model)]
    for step in range(steps):
        x, y = batch(kind, step)
        if step % 2:
            opt.zero_grad()  # grads stay views of the flat buffer: no copy at step()
        else:
            model.zero_grad()  # torch's default set_to_none=True: step() copies them in
        ((model(x[lo:lo + per_rank]) - y[lo:lo + per_rank]) ** 2).sum().div(per_rank).backward()
        opt.step()
        snaps.append(snapshot(model))
    return {"snaps": snaps, "shard": opt.shard_bounds, "bytes": opt.optimizer_state_bytes(),
            "staged": getattr(comm, "bytes_staged", 0) - staged,
            "state_keys": sorted(opt.local_state_dict()["state"].get(0, {}))}


def _bad_zero(comm, what: str) -> str:
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    model = make_model("tiny", SEED)
    try:
        if what == "algorithm":
            ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.SGD, comm, algorithm="tree", lr=0.1
            )
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm, lr=0.1)
            opt.consolidate_state_dict(to=comm.world_size)
    except ConfigError as e:
        return str(e)
    return "no error"


# -- tests -----------------------------------------------------------------------------------

def check_state_bytes(kind: str, opt_name: str, results: list[dict]) -> None:
    """Each rank holds its shard's state: n/p elements, give or take the chunking remainder."""
    model = make_model(kind, SEED)
    n, p = trainable(model), len(results)
    tensors = sum(1 for q in model.parameters() if q.requires_grad)
    unsharded = reference(kind, opt_name)[1]
    e, c = PER_ELEMENT[opt_name], PER_TENSOR[opt_name]
    assert unsharded == e * n + c * tensors
    for rank, r in enumerate(results):
        lo, hi = r["shard"]
        assert (lo, hi) == chunk_bounds(n, p)[rank]
        assert r["bytes"] == e * (hi - lo) + c
        assert e * (n // p) + c <= r["bytes"] <= e * -(-n // p) + c  # 1/p, up to the remainder
    assert sum(r["bytes"] - c for r in results) == unsharded - c * tensors


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_zero_equals_the_unsharded_optimizer_after_every_step(worlds, backend, p, opt_name):
    for kind in ("mlp", "tiny"):  # n = 63 (not divisible by 2 or 4) and n = 2 (< p for p > 2)
        results = worlds(p, backend).run(_train_zero, kind, opt_name)
        ref, _ = reference(kind, opt_name)
        for rank, r in enumerate(results):
            for step, (mine, theirs) in enumerate(zip(r["snaps"], ref)):
                for i, (a, b) in enumerate(zip(mine, theirs)):
                    assert rel(a, b) <= 1e-10, (
                        f"{kind} rank {rank} step {step} param {i}: {rel(a, b):.3g}"
                    )
                assert all(np.array_equal(a, b) for a, b in zip(mine, results[0]["snaps"][step])), \
                    f"{kind}: rank {rank} differs from rank 0 at step {step}"
            if kind == "mlp":  # the frozen bias: bitwise rank 0's initial value
                assert all(np.array_equal(s[-1], ref[0][-1]) for s in r["snaps"])
            assert r["staged"] == 0, "the flat buffers were not in shared memory"
        check_state_bytes(kind, opt_name, results)


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_optimizer_state_is_about_one_pth_of_the_unsharded(worlds, backend, p):
    results = worlds(p, backend).run(_train_zero, "wide", "adamw", 1)
    check_state_bytes("wide", "adamw", results)
    unsharded = reference("wide", "adamw")[1]
    per_rank = [r["bytes"] for r in results]
    print(f"\nZeRO-1 AdamW float64, n={trainable(make_model('wide', 0))}: unsharded {unsharded} B, "
          f"p={p}: per rank {per_rank} B ({max(per_rank) / unsharded:.3f} of unsharded)")
    assert max(per_rank) <= unsharded / p + PER_ELEMENT["adamw"] + PER_TENSOR["adamw"]
    assert results[0]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("what, needle", [("algorithm", "reduce-scatter"), ("to", "to must be a "
                                                                                  "rank")])
def test_bad_configurations_are_config_errors(worlds, what, needle):
    assert needle in worlds(1).run(_bad_zero, what)[0]
