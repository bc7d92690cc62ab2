"""FSDP as torch users expect it, checked against torch itself and against one process.

Torch keeps a wrapped module's parameters visible (FSDP1 ``use_orig_params=True``, FSDP2's
DTensors): ``named_parameters()`` gives the original names, an optimizer built from them after
wrapping trains, ``FSDP.clip_grad_norm_`` clips by the global norm, ``state_dict()`` has the
original keys. Here each original parameter is this rank's piece of its unit's flat shard
(``fsdp_flat``); the checks: AdamW over ``fsdp.parameters()`` with the global clip equals one
process running ``torch.nn.utils.clip_grad_norm_`` and AdamW on the whole batch (1e-10, float64),
and the norms it returns are torch's.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
F64, B, STEPS, SEED, MAX_NORM = torch.float64, 12, 3, 11, 0.05  # MAX_NORM: every step clips


def make_seq(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 8, dtype=F64), nn.Tanh(),
                         nn.Linear(8, 3, dtype=F64))


def seq_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(B, 5, generator=g, dtype=F64), torch.randn(B, 3, generator=g, dtype=F64)


def state(sd: dict) -> dict:
    return {k: v.detach().to(F64).numpy().copy() for k, v in sd.items()}


def one_process(norm_type: float) -> dict:
    """The whole batch, torch's own clip_grad_norm_ and AdamW: the norms and the final state."""
    model = make_seq(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        x, y = seq_batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return {"norms": norms, "state": state(model.state_dict()),
            "names": [n for n, _ in model.named_parameters()], "keys": list(model.state_dict())}


def _fsdp(comm, norm_type: float) -> dict:
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_seq(SEED + comm.rank)  # rank 0's weights win at construction
    originals = [id(q) for q in model.parameters()]
    fsdp = FSDP(model, comm, units=[model[0], model[2]])  # the root keeps model[4]
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)  # after wrapping, as torch asks
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    norms = []
    for step in range(STEPS):
        x, y = seq_batch(step)
        opt.zero_grad()
        (((fsdp(x[lo:hi]) - y[lo:hi]) ** 2).sum() / (3 * (hi - lo))).backward()
        norms.append(float(fsdp.clip_grad_norm_(MAX_NORM, norm_type)))
        opt.step()
    plain = make_seq(0)
    plain.load_state_dict(fsdp.state_dict())  # torch's own module takes the wrapper's state dict
    return {"norms": norms, "state": state(plain.state_dict()), "keys": list(fsdp.state_dict()),
            "names": [n for n, _ in fsdp.named_parameters()],
            "same_objects": [id(q) for q in fsdp.parameters()] == originals,
            "pieces": [q.numel() for q in fsdp.parameters()],
            "grad_is_view": all(q.grad is None or q.grad.untyped_storage().data_ptr()
                                == f.shard.grad.untyped_storage().data_ptr()
                                for fl in fsdp.units for f in fl for q in f.params)}


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


@pytest.mark.parametrize("p, norm_type", [(2, 2.0), (3, 2.0), (3, float("inf"))])
def test_adamw_with_global_clip_over_fsdp_parameters_trains_like_one_process(worlds, p, norm_type):
    want = one_process(norm_type)
    results = worlds(p).run(_fsdp, norm_type)
    for rank, r in enumerate(results):
        assert r["names"] == want["names"] and r["keys"] == want["keys"], rank  # "0.weight", not flat_params
        assert r["same_objects"] and r["grad_is_view"], rank
        assert max(abs(a - b) / b for a, b in zip(r["norms"], want["norms"])) <= 1e-10, (rank, r["norms"])
        assert r["norms"][0] > MAX_NORM, "the test should clip"
        for k, v in want["state"].items():
            assert rel(r["state"][k], v) <= 1e-10, (rank, k)
    pieces = [sum(s) for s in zip(*(r["pieces"] for r in results))]  # each parameter tiled by the ranks
    assert pieces == [q.numel() for q in make_seq(0).parameters()]


def _local_clip(comm) -> tuple[float, float]:
    """torch.nn.utils.clip_grad_norm_ over the pieces sees this rank's part only; the method sees all."""
    from dplab.backends.nn.fsdp import FSDP

    fsdp = FSDP(make_seq(SEED), comm)
    x, y = seq_batch(0)
    ((fsdp(x) - y) ** 2).mean().backward()
    local = torch.nn.utils.get_total_norm([q.grad for q in fsdp.parameters()])
    return float(local), float(fsdp.clip_grad_norm_(1e9))


def test_a_plain_clip_sees_one_rank_the_method_sees_all(worlds):
    locals_, globals_ = zip(*worlds(2).run(_local_clip))
    assert globals_[0] == globals_[1]
    assert abs(np.hypot(*locals_) - globals_[0]) <= 1e-12 * globals_[0]
    assert all(loc < globals_[0] for loc in locals_)
