"""ZeRO where a ``torch.optim.Optimizer`` is expected: groups, schedulers, state dicts.

One process with ``torch.optim.AdamW`` is the reference: two parameter groups with their own
lr and weight_decay, a ``StepLR``, and at step 2 a frozen bias unfrozen and added with
``add_param_group``. Each ZeRO rank does the same on its shard of the batch; parameters must
agree within relative 1e-10 (float64) after every step. The state dict ZeRO consolidates is
the reference's (same indices, keys and numbers), loads into a plain AdamW, and a plain
AdamW's loads into ZeRO; either way training continues as it would have.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from tiers import engines

torch = pytest.importorskip("torch")
from strategies import one_at_a_time, seed_torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.lr_scheduler import StepLR  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo once, before forks

B, SEED, F64 = 24, 5, torch.float64
BEFORE, AFTER, UNFREEZE = 3, 2, 2  # steps before the state is saved, after; the step a group joins


@one_at_a_time
def make_model(seed: int) -> nn.Module:
    seed_torch(seed)
    model = nn.Sequential(nn.Linear(5, 7, dtype=F64), nn.Tanh(), nn.Linear(7, 3, dtype=F64))
    model[2].bias.requires_grad_(False)  # unfrozen at step UNFREEZE
    return model


def param_groups(model: nn.Module, late: bool = False) -> list[dict]:
    groups = [{"params": list(model[0].parameters()), "lr": 0.02, "weight_decay": 0.1},
              {"params": [model[2].weight], "lr": 0.05, "weight_decay": 0.0}]
    return groups + [late_group(model)] if late else groups


def late_group(model: nn.Module) -> dict:
    return {"params": [model[2].bias], "lr": 0.03}


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(B, 5, generator=g, dtype=F64), torch.randn(B, 3, generator=g, dtype=F64)


def snapshot(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def train(model, opt, sched, steps: range, lo: int, hi: int) -> list:
    snaps = []
    for step in steps:
        if step == UNFREEZE and not model[2].bias.requires_grad:
            model[2].bias.requires_grad_(True)
            opt.add_param_group(late_group(model))
        x, y = batch(step)
        opt.zero_grad()
        ((model(x[lo:hi]) - y[lo:hi]) ** 2).sum().div(hi - lo).backward()
        opt.step()
        sched.step()
        snaps.append(snapshot(model))
    return snaps


def resumed(model, opt, sched_state: dict):
    """torch's resume order: the optimizer's state first, then a scheduler loaded over it."""
    sched = StepLR(opt, step_size=2, gamma=0.5)
    sched.load_state_dict(sched_state)
    return sched


def reference() -> dict:
    model = make_model(SEED)
    opt = torch.optim.AdamW(param_groups(model), lr=0.01)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    before = train(model, opt, sched, range(BEFORE), 0, B)
    saved = {
        "state": copy.deepcopy(opt.state_dict()),
        "params": snapshot(model),
        "sched": sched.state_dict(),
    }
    after = train(model, opt, sched, range(BEFORE, BEFORE + AFTER), 0, B)
    return {"before": before, "after": after, **saved}


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


def close(mine: list, theirs: list, label: str, tol: float = 1e-10) -> None:
    for step, (a_s, b_s) in enumerate(zip(mine, theirs, strict=True)):
        for i, (a, b) in enumerate(zip(a_s, b_s, strict=True)):
            assert rel(a, b) <= tol, f"{label} step {step} param {i}: {rel(a, b):.3g}"


# -- rank functions (module level: persistent worlds pickle them) -----------------------------

def _zero(comm, model):
    from dplab.backends.nn.ddp import broadcast_module
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer

    broadcast_module(model, comm)
    late = model[2].bias.requires_grad
    return ZeroRedundancyOptimizer(param_groups(model, late), torch.optim.AdamW, comm, lr=0.01)


def _train_save_resume(comm) -> dict:
    """Train, consolidate onto every rank in turn, go on; and resume a fresh ZeRO from the dict."""
    torch.set_num_threads(1)
    per = B // comm.world_size
    lo, hi = comm.rank * per, (comm.rank + 1) * per
    model = make_model(SEED + comm.rank)
    opt = _zero(comm, model)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    try:
        opt.state_dict()
        unconsolidated = "no error"
    except ConfigError as e:
        unconsolidated = str(e)
    before = train(model, opt, sched, range(BEFORE), lo, hi)
    for to in range(comm.world_size):  # torch's convention: gather onto one rank at a time
        opt.consolidate_state_dict(to=to)
        if to == comm.rank:
            state = opt.state_dict()
    params, sched_state = snapshot(model), sched.state_dict()
    after = train(model, opt, sched, range(BEFORE, BEFORE + AFTER), lo, hi)
    fresh = make_model(SEED + 1)  # other weights: the saved ones are loaded below
    fresh[2].bias.requires_grad_(True)
    with torch.no_grad():
        for p, saved in zip(fresh.parameters(), params):
            p.copy_(torch.from_numpy(saved))
    opt2 = _zero(comm, fresh)
    opt2.load_state_dict(state)
    again = train(
        fresh, opt2, resumed(fresh, opt2, sched_state), range(BEFORE, BEFORE + AFTER), lo, hi
    )
    return {
        "before": before,
        "after": after,
        "again": again,
        "state": pickle.dumps(state),
        "params": params,
        "sched": sched_state,
        "unconsolidated": unconsolidated,
        "lrs": [g["lr"] for g in opt.param_groups],
        "inner_lrs": [g["lr"] for g in opt.optim.param_groups],
    }


def _resume_from_torch(comm, params: list, state: bytes, sched_state: dict) -> list:
    """A plain AdamW's state dict, loaded into ZeRO: training goes on as the plain one's did.
    State dicts travel pickled (plain pickle): a tensor sent through multiprocessing's pipes
    would travel as a file descriptor to share, which MPI ranks cannot fetch."""
    torch.set_num_threads(1)
    state = pickle.loads(state)
    per = B // comm.world_size
    model = make_model(SEED)
    model[2].bias.requires_grad_(True)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params):
            p.copy_(torch.from_numpy(saved))
    opt = _zero(comm, model)
    opt.load_state_dict(state)
    sched = resumed(model, opt, sched_state)
    return train(
        model, opt, sched, range(BEFORE, BEFORE + AFTER), comm.rank * per, (comm.rank + 1) * per
    )


# -- tests -----------------------------------------------------------------------------------

# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_groups_scheduler_and_add_param_group_equal_torch_optim(worlds, backend, p):
    ref = reference()
    for rank, r in enumerate(worlds(p, backend).run(_train_save_resume)):
        close(r["before"] + r["after"], ref["before"] + ref["after"], f"rank {rank}")
        # StepLR's halvings
        assert r["lrs"] == r["inner_lrs"] == [0.02 * 0.25, 0.05 * 0.25, 0.03 * 0.5]
        assert "consolidate_state_dict" in r["unconsolidated"]


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 3, 4]), indirect=["backend"])
def test_state_dict_is_torchs_and_a_round_trip_trains_on_identically(worlds, backend, p):
    ref = reference()
    theirs = ref["state"]
    for rank, r in enumerate(worlds(p, backend).run(_train_save_resume)):
        for a, b in zip(r["after"], r["again"], strict=True):  # resumed ZeRO == uninterrupted ZeRO
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank}"
        mine = pickle.loads(r["state"])
        assert [g["params"] for g in mine["param_groups"]] == [
            g["params"] for g in theirs["param_groups"]
        ]
        assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]
        assert sorted(mine["state"]) == sorted(theirs["state"]) == [0, 1, 2, 3]
        for i, s in theirs["state"].items():
            assert list(mine["state"][i]) == list(s)  # step, exp_avg, exp_avg_sq
            for key, value in s.items():
                assert rel(mine["state"][i][key].numpy(), value.numpy()) <= 1e-10, f"{i} {key}"
    # the consolidated dict drives a plain torch AdamW on one process just as ZeRO went on
    model = make_model(SEED)
    model[2].bias.requires_grad_(True)
    with torch.no_grad():
        for q, saved in zip(model.parameters(), r["params"]):
            q.copy_(torch.from_numpy(saved))
    opt = torch.optim.AdamW(param_groups(model, late=True), lr=0.01)
    opt.load_state_dict(pickle.loads(r["state"]))
    sched = resumed(model, opt, r["sched"])
    close(train(model, opt, sched, range(BEFORE, BEFORE + AFTER), 0, B), r["after"], "plain from "
                                                                                     "ZeRO's")


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3]), indirect=["backend"])
def test_a_plain_adamw_state_dict_loads_into_zero(worlds, backend, p):
    ref = reference()
    state = pickle.dumps(ref["state"])
    results = worlds(p, backend).run(_resume_from_torch, ref["params"], state, ref["sched"])
    for rank, snaps in enumerate(results):
        close(snaps, ref["after"], f"rank {rank}")
