"""FSDP == single-process training on the global batch, after every step.

The reference trains a plain copy of the module on the whole global batch (mean loss) with
AdamW (weight decay on: a frozen parameter that reached the optimizer with a gradient would
move); each FSDP rank trains on its shard with AdamW over ``fsdp.parameters()`` (the original
parameters, each this rank's piece of its unit's flat shard). After every step
``full_state_dict()`` must equal the reference's ``state_dict()`` within relative 1e-10
(float64), bitwise the same on every rank, for one unit, several units, frozen and tied
parameters, world sizes 1-4, on every backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiers import engines

torch = pytest.importorskip("torch")
from strategies import one_at_a_time, seed_torch  # noqa: E402
from torch import nn  # noqa: E402

from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch._dynamo once, before the forks

B, STEPS, SEED, F64 = 12, 3, 7, torch.float64  # B divides by 1..4


# -- models and data (module level: MPI ranks unpickle what they run) ------------------------

class Frozen(nn.Module):
    """A frozen weight (its bias trains) and a float buffer, both from rank 0."""

    def __init__(self, dtype: torch.dtype = F64) -> None:
        super().__init__()
        self.inp, self.mid, self.out = (nn.Linear(5, 8, dtype=dtype), nn.Linear(8, 8, dtype=dtype),
                                        nn.Linear(8, 3, dtype=dtype))
        self.mid.weight.requires_grad_(False)
        self.register_buffer("scale", torch.rand(8, dtype=dtype) + 0.5)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))) * self.scale)


class Tied(nn.Module):
    """A tiny language model whose output projection is its embedding (one Parameter, two uses)."""

    def __init__(self, dtype: torch.dtype = F64) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(11, 6, dtype=dtype), nn.Linear(6, 6, dtype=dtype)
        self.head = nn.Linear(6, 11, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class Stack(nn.Module):
    """Equal blocks, one unit each, and a root-owned head: the memory test's model."""

    def __init__(self, dtype: torch.dtype = F64, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width, dtype=dtype) for _ in range(depth))
        self.head = nn.Linear(width, 2, dtype=dtype)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


MODELS = {"frozen": Frozen, "tied": Tied, "stack": Stack}
UNITS = {  # unit configurations by name: attribute paths of submodules
    "whole": [],
    "frozen2": ["inp", "out"],             # the root keeps mid (frozen weight + trainable bias)
    "frozen3": ["inp", "mid", "out"],      # a unit with a frozen and a trainable flat
    # emb's weight is also head's: the root owns it, emb is empty
    "tied_emb": ["emb", "mid"],
    "tied_head": ["mid", "head"],
    "stack": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
}
CASES = [("frozen", "whole"), ("frozen", "frozen2"), ("frozen", "frozen3"),
         ("tied", "whole"), ("tied_emb", "tied_emb"), ("tied", "tied_head"), ("stack", "stack")]


def kind_of(name: str) -> str:
    return name.split("_")[0]


@one_at_a_time
def make_model(kind: str, seed: int, dtype: torch.dtype = F64) -> nn.Module:
    seed_torch(seed)
    return MODELS[kind_of(kind)](dtype)


def units_of(model: nn.Module, config: str) -> list[nn.Module] | None:
    names = UNITS[config]
    return [model.get_submodule(n) for n in names] if names else None


def batch(kind: str, step: int, n: int = B, dtype: torch.dtype = F64) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    if kind_of(kind) == "tied":
        return torch.randint(0, 11, (n,), generator=g), torch.randint(0, 11, (n,), generator=g)
    dim = {"frozen": (5, 3), "stack": (16, 2)}[kind_of(kind)]
    return torch.randn(n, dim[0], generator=g, dtype=dtype), torch.randn(
        n, dim[1], generator=g, dtype=dtype
    )


def loss_sum(kind: str, out, y):
    """Sum of per-sample losses (in the target's dtype): divide by the shard size for the mean."""
    if kind_of(kind) == "tied":
        return nn.functional.cross_entropy(out.to(F64), y, reduction="sum")
    return ((out.to(y.dtype) - y) ** 2).sum()


def make_opt(params, kind: str = "adamw"):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def numpy_state(sd: dict) -> dict:
    return {k: v.detach().cpu().to(torch.float64).numpy().copy() for k, v in sd.items()}


def reference(kind: str, steps: int = STEPS, n: int = B) -> list[dict]:
    """Single process, whole global batch, mean loss: the state dict before and after each step."""
    model = make_model(kind, SEED)
    opt = make_opt(model.parameters())
    snaps = [numpy_state(model.state_dict())]
    for step in range(steps):
        x, y = batch(kind, step, n)
        opt.zero_grad()
        (loss_sum(kind, model(x), y) / n).backward()
        opt.step()
        snaps.append(numpy_state(model.state_dict()))
    return snaps


def rel(a, b) -> float:
    """max|a - b| / max(1, max|b|): relative for large values, absolute near zero."""
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


# -- rank functions --------------------------------------------------------------------------

def _train(
    comm, kind: str, config: str, n: int = B, weighted: bool = False, steps: int = STEPS
) -> dict:
    """FSDP on this rank's shard of every batch (chunk_bounds: uneven when p does not divide n)."""
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_model(kind, SEED + comm.rank)  # the broadcast must make it rank 0's
    lo, hi = chunk_bounds(n, comm.world_size)[comm.rank]
    fsdp = FSDP(
        model, comm, units=units_of(model, config), local_batch_size=hi - lo if weighted else None
    )
    opt = make_opt(fsdp.parameters())
    snaps = [numpy_state(fsdp.full_state_dict())]
    for step in range(steps):
        x, y = batch(kind, step, n)
        opt.zero_grad()
        (loss_sum(kind, fsdp(x[lo:hi]), y[lo:hi]) / max(hi - lo, 1)).backward()
        opt.step()
        snaps.append(numpy_state(fsdp.full_state_dict()))
    flats = [f for fl in fsdp.units for f in fl]
    return {"snaps": snaps, "names": [name for name, _ in fsdp.named_parameters()],
            "shard_sizes": [p.numel() for p in fsdp.parameters()],
            "trainable": [p.requires_grad for p in fsdp.parameters()],
            "frozen_grads_none": all(f.shard.grad is None for f in flats if not f.trainable),
            "leaf_bytes_after": sum(f.leaf.untyped_storage().nbytes() for f in flats),
            "module_names": [name for name, _ in model.named_parameters()]}


def check(results: list[dict], ref: list[dict], label: str, tol: float = 1e-10) -> None:
    for rank, r in enumerate(results):
        assert len(r["snaps"]) == len(ref), label
        for step, (mine, theirs) in enumerate(zip(r["snaps"], ref)):
            assert mine.keys() == theirs.keys(), label
            for key in theirs:
                assert rel(mine[key], theirs[key]) <= tol, \
                    f"{label} rank {rank} step {step} {key}: {rel(mine[key], theirs[key]):.3g}"
                assert np.array_equal(mine[key], results[0]["snaps"][step][key]), \
                    f"{label}: rank {rank} differs from rank 0 at step {step} in {key}"


# -- tests -----------------------------------------------------------------------------------

# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_fsdp_equals_single_process_after_every_step(worlds, backend, p):
    world = worlds(p, backend)
    for kind, config in CASES:
        label = f"{kind}/{config} p={p}"
        results = world.run(_train, kind, config)
        ref = reference(kind)
        check(results, ref, label)
        names = [name for name, _ in make_model(kind, SEED).named_parameters()]
        for r in results:
            # the original parameters, under their own names, as torch's FSDP keeps them
            assert r["module_names"] == r["names"] == names, label
            assert r["frozen_grads_none"], f"{label}: a frozen flat got a gradient"
            assert r["leaf_bytes_after"] == 0, f"{label}: gathered parameters outlived the step"
        # per parameter, over ranks
        total = [sum(ss) for ss in zip(*(r["shard_sizes"] for r in results))]
        model = make_model(kind, SEED)
        assert total == [q.numel() for q in model.parameters()], (
            f"{label}: the pieces do not tile them"
        )
        if kind_of(kind) == "frozen":
            # mid.weight: rank 0's initial value, bitwise, after every step
            frozen = ref[0]["mid.weight"]
            assert all(np.array_equal(s["mid.weight"], frozen) for r in results for s in r["snaps"])


# 4/3/3 on every engine, 3/3/2/2 on local (and on the others in the slow tier: tiers.py)
@pytest.mark.parametrize("backend, p", engines([3, 4]), indirect=["backend"])
def test_uneven_shards_weighted_by_local_batch_size(worlds, backend, p):
    """10 samples on 3 or 4 ranks (4/3/3, 3/3/2/2): local_batch_size makes it the full batch's
    step."""
    world = worlds(p, backend)
    for kind, config in [("frozen", "frozen3"), ("tied", "tied_head")]:
        check(world.run(_train, kind, config, 10, True), reference(kind, n=10), f"{kind} uneven "
                                                                                f"p={p}")
