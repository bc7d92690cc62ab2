"""FSDP's no_sync (accumulation without communication) and BatchNorm under compute_dtype.

no_sync: k micro-batches inside ``no_sync()`` and one outside take the big batch's step (1e-10 of
one process, float64), and the trace shows one reduce-scatter per trainable flat per step, not
k + 1; while they wait, the full gradients held are exactly the trainable flats' size. A unit whose
gradient came only from a no_sync micro-batch still reduces it at the synced backward's end.

BatchNorm: FSDP casts the buffers to the compute dtype for each forward and writes an in-place
change (the running statistics) back to the fp32 master. So after every step the module's own
buffers are fp32, hold bf16 (fp16) values, and equal one process that keeps a bf16 copy per rank
and applies the same casts: bit for bit after the first step (the weights are then the same bits),
within a 16-bit rounding after later ones (the masters differ by fp32 rounding, see
test_fsdp_extras). Each rank keeps its own statistics, as in torch's FSDP (no buffer sync).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from test_fsdp import (  # noqa: E402
    SEED,
    STEPS,
    B,
    batch,
    loss_sum,
    make_model,
    numpy_state,
    reference,
    rel,
    units_of,
)
from torch import nn  # noqa: E402

from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
F32 = torch.float32


def _accumulate(comm, micro: int, no_sync: bool, compute=None) -> dict:
    """Each step: ``micro`` micro-batches of this rank's shard (loss / shard size each), the first
    micro - 1 inside no_sync when asked; the reduce-scatters per step counted from the trace."""
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    dtype = torch.float64 if compute is None else F32
    model = make_model("frozen", SEED + comm.rank, dtype)
    fsdp = FSDP(model, comm, units=units_of(model, "frozen3"), compute_dtype=compute)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    counts, held = [], []
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        for step in range(STEPS):
            x, y = batch("frozen", step, B, dtype)
            opt.zero_grad()
            parts = chunk_bounds(hi - lo, micro)
            for i, (a, b) in enumerate(parts):
                last = i == len(parts) - 1
                with fsdp.no_sync() if no_sync and not last else _nothing():
                    out = fsdp(x[lo + a:lo + b])
                    (loss_sum("frozen", out, y[lo + a:lo + b]) / (hi - lo)).backward()
                held.append(fsdp.param_memory()["held_grad_bytes"])
            opt.step()
            counts.append(sum(e.kind == "reduce_scatter" for e in comm.tracer.take()))
    finally:
        comm.tracer.enabled = False
    trainable = [f.n * f.shard.element_size() for fl in fsdp.units for f in fl if f.trainable]
    return {"state": numpy_state(fsdp.full_state_dict()), "counts": counts, "held": held,
            "full_grad_bytes": sum(trainable), "flats": len(trainable)}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *_):
        return False


@pytest.mark.parametrize("p", [1, 2, 3])
def test_no_sync_micro_batches_take_the_big_batch_step_with_one_reduce_scatter(worlds, p):
    want = reference("frozen")[-1]
    k = 3  # micro-batches inside no_sync, one outside
    for with_sync, r in [(True, x) for x in worlds(p).run(_accumulate, k + 1, True)] + \
                        [(False, x) for x in worlds(p).run(_accumulate, k + 1, False)]:
        assert max(rel(r["state"][key], want[key]) for key in want) <= 1e-10
        assert r["flats"] == 3  # inp, mid's bias (its weight is frozen), out
        if with_sync:
            assert r["counts"] == [r["flats"]] * STEPS  # one reduce-scatter per unit per step
            full = r["full_grad_bytes"]
            assert r["held"] == [full, full, full, 0] * STEPS  # full gradients wait, then are sent
        else:
            assert r["counts"] == [r["flats"] * (k + 1)] * STEPS  # one per micro-batch
            assert r["held"] == [0] * (k + 1) * STEPS


def test_no_sync_on_every_backend(worlds, backend):
    want = reference("frozen")[-1]
    for r in worlds(3, backend).run(_accumulate, 2, True):
        assert (
            max(rel(r["state"][key], want[key]) for key in want) <= 1e-10
            and r["counts"] == [3] * STEPS
        )


def test_no_sync_in_bf16_sums_the_micro_batches_in_fp32(worlds):
    """The same step as reducing each micro-batch (both add fp32 gradients; only the order
    differs)."""
    held = worlds(2).run(_accumulate, 3, True, torch.bfloat16)
    each = worlds(2).run(_accumulate, 3, False, torch.bfloat16)
    for a, b in zip(held, each):
        assert max(rel(a["state"][k], b["state"][k]) for k in a["state"]) <= 2e-6


class Switch(nn.Module):
    """Two units; ``spare`` runs (or not) and feeds the loss only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = (
            nn.Linear(3, 2, dtype=torch.float64),
            nn.Linear(3, 2, dtype=torch.float64),
        )

    def forward(self, x, mode: str):
        if mode == "skip":
            return self.used(x)
        out = self.spare(x)
        return self.used(x) + (out if mode == "use" else 0 * out.detach())


def _switch(comm, last: str) -> dict:
    """A no_sync micro-batch uses both units; the synced one uses only ``used`` (spare runs
    without a gradient, or does not run): spare's held gradient must still be reduced."""
    from dplab.backends.nn.fsdp import FSDP

    torch.manual_seed(0)
    model = Switch()
    fsdp = FSDP(model, comm, units=[model.used, model.spare])
    opt = torch.optim.SGD(fsdp.parameters(), lr=1.0)
    x = torch.full((4, 3), comm.rank + 1.0, dtype=torch.float64)
    with fsdp.no_sync():
        fsdp(x, "use").sum().backward()
    fsdp(x, last).sum().backward()
    opt.step()
    return numpy_state(fsdp.full_state_dict())


@pytest.mark.parametrize("last", ["unused", "skip"])
def test_a_unit_with_only_held_gradient_reduces_it(worlds, last):
    torch.manual_seed(0)
    plain, p = Switch(), 2
    for r in range(p):  # the big batch: each rank's micro-batches, gradients averaged over ranks
        x = torch.full((4, 3), r + 1.0, dtype=torch.float64)
        ((plain(x, "use").sum() + plain(x, last).sum()) / p).backward()
    want = {
        k: v - (plain.get_parameter(k).grad.numpy())
        for k, v in numpy_state(plain.state_dict()).items()
    }
    for state in worlds(p).run(_switch, last):
        for k in want:
            np.testing.assert_allclose(state[k], want[k], rtol=1e-12, atol=1e-12)


# -- BatchNorm under compute_dtype --------------------------------------------------------------

class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn, self.out = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


def norm_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(B, 5, generator=g) * 3 + 1, torch.randn(B, 3, generator=g)  # mean 1, var 9


BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def norm_reference(p: int, dtype) -> list[list[dict]]:
    """One process: fp32 masters, per rank a ``dtype`` copy with that rank's own buffers; its
    running statistics written back to the rank's fp32 buffers. [step][rank] -> buffers."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    master = Norm()
    opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    bufs = [
        {k: v.clone() for k, v in master.state_dict().items() if k in BUFFERS} for _ in range(p)
    ]
    out = []
    for step in range(STEPS):
        x, y = norm_batch(step)
        opt.zero_grad()
        for r, (lo, hi) in enumerate(chunk_bounds(B, p)):
            low = copy.deepcopy(master)
            low.load_state_dict({**master.state_dict(), **bufs[r]})
            low = low.to(dtype)
            (((low(x[lo:hi].to(dtype)).to(F32) - y[lo:hi]) ** 2).sum() / (hi - lo)).backward()
            for m, q in zip(master.parameters(), low.parameters()):
                g = q.grad.to(F32) / p
                m.grad = g if m.grad is None else m.grad + g
            bufs[r] = {
                k: v.to(bufs[r][k].dtype) for k, v in low.state_dict().items() if k in BUFFERS
            }
        opt.step()
        out.append([{k: v.numpy().copy() for k, v in b.items()} for b in bufs])
    return out


def _norm(comm, dtype) -> dict:
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = Norm()
    fsdp = FSDP(model, comm, units=[model.inp, model.bn, model.out], compute_dtype=dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    steps = []
    for step in range(STEPS):
        x, y = norm_batch(step)
        opt.zero_grad()
        (((fsdp(x[lo:hi]).to(F32) - y[lo:hi]) ** 2).sum() / (hi - lo)).backward()
        opt.step()
        steps.append({k: model.get_buffer(k).numpy().copy() for k in BUFFERS})
    dtypes = {k: str(model.get_buffer(k).dtype) for k in BUFFERS}
    fsdp.eval()
    # an fp32 value that no 16-bit float holds: no needless round trip
    model.bn.running_mean.fill_(0.1)
    before = {k: model.get_buffer(k).clone() for k in BUFFERS}
    fsdp(norm_batch(0)[0])  # evaluation reads the statistics (in bf16) and changes nothing
    unchanged = all(torch.equal(before[k], model.get_buffer(k)) for k in BUFFERS)
    return {
        "steps": steps,
        "dtypes": dtypes,
        "eval_unchanged": unchanged,
        "state": {k: v.numpy().copy() for k, v in fsdp.full_state_dict().items() if k in BUFFERS},
        "after_eval": model.bn.running_mean.numpy().copy(),
    }


def dtype_of(v: float, dtype) -> float:
    return float(torch.tensor(v).to(dtype).float())


@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("p", [1, 2])
def test_batchnorm_running_statistics_under_compute_dtype(worlds, p, name):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    want = norm_reference(p, dtype)
    fp32 = norm_reference(p, F32)
    results = worlds(p).run(_norm, dtype)
    for rank, r in enumerate(results):
        assert r["dtypes"] == {
            "bn.running_mean": "torch.float32",
            "bn.running_var": "torch.float32",
            "bn.num_batches_tracked": "torch.int64",
        }
        assert r["eval_unchanged"]
        for step, got in enumerate(r["steps"]):
            mine = want[step][rank]
            assert int(got["bn.num_batches_tracked"]) == step + 1
            for k in BUFFERS[:2]:
                low = torch.from_numpy(got[k]).to(dtype).to(F32).numpy()
                np.testing.assert_array_equal(got[k], low)  # written back from the 16-bit update
                if step == 0:  # the same weights' bits, the same statistics' bits
                    np.testing.assert_array_equal(got[k], mine[k])
                else:
                    assert rel(got[k], mine[k]) <= 2 * 2.0 ** -8, (step, k)
        last = r["steps"][-1]
        assert np.all(r["after_eval"] == np.float32(0.1)) and np.float32(0.1) != dtype_of(
            0.1, dtype
        )
        # the state dict's
        assert np.array_equal(r["state"]["bn.running_var"], last["bn.running_var"])
        # the casts mattered
        assert max(rel(last[k], fp32[-1][rank][k]) for k in BUFFERS[:2]) > 1e-4
    if p > 1:  # each rank's statistics are its own shard's
        a, b = (r["steps"][-1]["bn.running_mean"] for r in results)
        assert not np.array_equal(a, b)
