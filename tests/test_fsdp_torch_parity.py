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

import copy
import time
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from strategies import one_at_a_time  # noqa: E402
from torch import nn  # noqa: E402

from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
F64, B, STEPS, SEED, MAX_NORM = torch.float64, 12, 3, 11, 0.05  # MAX_NORM: every step clips


@one_at_a_time
def make_seq(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8, dtype=F64),
        nn.Tanh(),
        nn.Linear(8, 8, dtype=F64),
        nn.Tanh(),
        nn.Linear(8, 3, dtype=F64),
    )


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
    # after wrapping, as torch asks
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)
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
        # "0.weight", not flat_params
        assert r["names"] == want["names"] and r["keys"] == want["keys"], rank
        assert r["same_objects"] and r["grad_is_view"], rank
        assert max(abs(a - b) / b for a, b in zip(r["norms"], want["norms"])) <= 1e-10, (
            rank,
            r["norms"],
        )
        assert r["norms"][0] > MAX_NORM, "the test should clip"
        for k, v in want["state"].items():
            assert rel(r["state"][k], v) <= 1e-10, (rank, k)
    # each parameter tiled by the ranks
    pieces = [sum(s) for s in zip(*(r["pieces"] for r in results))]
    assert pieces == [q.numel() for q in make_seq(0).parameters()]


def _local_clip(comm) -> tuple[float, float]:
    """torch.nn.utils.clip_grad_norm_ over the pieces sees this rank's part only;
    the method sees all."""
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


# -- a mixed-precision policy per unit, norms kept in float32 ----------------------------------

F32, F16 = torch.float32, torch.float16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)))


class Net(nn.Module):
    """A root-owned input layer and head around two blocks (one unit each) with a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(5, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@one_at_a_time
def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # LayerNorm starts at 1 and 0: make its float32 weights matter
        for b in net.blocks:
            b.norm.weight.uniform_(0.5, 1.5)
            b.norm.bias.uniform_(-0.5, 0.5)
    return net


def net_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(B, 5, generator=g), torch.randn(B, 3, generator=g)


def _cast_in(dtype, _m, args, kwargs):
    return tuple(a.to(dtype) for a in args), kwargs


def low_copy(master: Net, units: dict[str, torch.dtype], keep: tuple) -> Net:
    """The casts the policy promises, by hand: each unit's parameters and inputs in its dtype (the
    root's in float32 here), kept modules in float32 with their output back in their unit's
    dtype."""
    low = copy.deepcopy(master)
    for name, dtype in units.items():
        unit = low.get_submodule(name).to(dtype)
        unit.register_forward_pre_hook(partial(_cast_in, dtype), with_kwargs=True)
        for path, m in unit.named_modules():
            if isinstance(m, keep):  # the master's float32 values, not a float16 round trip
                m.float().load_state_dict(master.get_submodule(name).get_submodule(path).state_dict())
                m.register_forward_pre_hook(partial(_cast_in, F32), with_kwargs=True)
                m.register_forward_hook(lambda _m, _a, out, d=dtype: out.to(d))
    return low


def same_casts(p: int, units: dict[str, torch.dtype], keep: tuple) -> dict:
    """One process, float32 masters and SGD; per rank's shard a low copy computes the gradient,
    cast to float32 (the reduce dtype) and averaged over the shards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same kernels, the same roundings
    try:
        master = make_net(SEED)
        opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = net_batch(step)
            opt.zero_grad()
            for lo, hi in chunk_bounds(B, p):
                low = low_copy(master, units, keep)
                (((low(x[lo:hi]).float() - y[lo:hi]) ** 2).sum() / (3 * (hi - lo))).backward()
                for m, q in zip(master.parameters(), low.parameters()):
                    g = q.grad.to(F32) * (1 / p)
                    m.grad = g if m.grad is None else m.grad + g
            opt.step()
        return state(master.state_dict())
    finally:
        torch.set_num_threads(threads)


def _mixed(comm, per_unit: bool) -> dict:
    from dplab.backends.nn.fsdp import FSDP, MixedPrecision

    torch.set_num_threads(1)
    model = make_net(SEED + comm.rank)
    mp = MixedPrecision(param_dtype=F16, reduce_dtype=F32)
    if per_unit:  # the first block in float16 (its norm too), the second and the root in float32
        fsdp = FSDP(model, comm, units=list(model.blocks), mixed_precision={model.blocks[0]: mp})
    else:
        fsdp = FSDP(
            model, comm, units=list(model.blocks), mixed_precision=mp, keep_float32=(nn.LayerNorm,)
        )
    seen = {}

    def look(name, mod, _args, out) -> None:  # what each layer computed in: (weight, output) dtypes
        seen.setdefault(name, (str(mod.weight.dtype), str(out.dtype)))

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.register_forward_hook(partial(look, name))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    for step in range(STEPS):
        x, y = net_batch(step)
        opt.zero_grad()
        (((fsdp(x[lo:hi]).float() - y[lo:hi]) ** 2).sum() / (3 * (hi - lo))).backward()
        opt.step()
    return {"state": state(fsdp.state_dict()), "seen": seen,
            "masters": sorted({str(q.dtype) for q in fsdp.parameters()})}


@pytest.mark.parametrize("per_unit", [False, True])
def test_mixed_precision_policy_equals_one_process_with_the_same_casts(worlds, per_unit):
    p = 2
    if per_unit:
        units, keep = {"blocks.0": F16, "blocks.1": F32}, ()
        want_seen = {
            "inp": ("torch.float32",) * 2,
            "blocks.0.lin": ("torch.float16",) * 2,
            "blocks.0.norm": ("torch.float16",) * 2,
            "blocks.1.lin": ("torch.float32",) * 2,
            "blocks.1.norm": ("torch.float32",) * 2,
            "head": ("torch.float32",) * 2,
        }
    else:
        units, keep = {"": F16}, (nn.LayerNorm,)
        # LN: fp32 weights, fp16 out
        half, kept = ("torch.float16",) * 2, ("torch.float32", "torch.float16")
        want_seen = {"inp": half, "blocks.0.lin": half, "blocks.0.norm": kept, "blocks.1.lin": half,
                     "blocks.1.norm": kept, "head": half}
    want = same_casts(p, units, keep)
    plain = same_casts(p, {}, ())  # all float32: the casts must matter
    for r in worlds(p).run(_mixed, per_unit):
        assert r["seen"] == want_seen and r["masters"] == ["torch.float32"]
        # bitwise: each shard's forward and backward are the same kernels on the same numbers, and
        # a sum of two float32 gradients does not depend on its order
        assert all(np.array_equal(r["state"][k], v) for k, v in want.items())
        assert max(rel(r["state"][k], v) for k, v in plain.items()) > 1e-4


# -- gathers prefetched on the comm thread, overlapped with compute ----------------------------

def _prefetch_states(comm, prefetch: bool) -> list:
    """A few configurations from test_fsdp, three steps each, the middle one accumulated under
    no_sync: every state dict, to compare bit for bit with and without prefetch."""
    from test_fsdp import batch, loss_sum, make_model, make_opt, numpy_state, units_of

    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    more = {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"} if prefetch else {}
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    out = []
    for kind, config in [("stack", "stack"), ("tied", "tied_head"), ("frozen", "frozen3")]:
        model = make_model(kind, SEED)
        fsdp = FSDP(model, comm, units=units_of(model, config), **more)
        opt = make_opt(fsdp.parameters())
        for step in range(STEPS):
            x, y = batch(kind, step, B)
            opt.zero_grad()
            if step == 1:
                with fsdp.no_sync():
                    (loss_sum(kind, fsdp(x[lo:hi]), y[lo:hi]) / (hi - lo)).backward()
            (loss_sum(kind, fsdp(x[lo:hi]), y[lo:hi]) / (hi - lo)).backward()
            opt.step()
            out.append(numpy_state(fsdp.state_dict()))
    return out


def same_with_and_without_prefetch(world) -> None:
    plain, ahead = world.run(_prefetch_states, False), world.run(_prefetch_states, True)
    for mine, theirs in zip(ahead, plain):
        for a, b in zip(mine, theirs):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_prefetch_is_bitwise_the_same_training(worlds):
    same_with_and_without_prefetch(worlds(3))


def test_prefetch_from_the_comm_thread_on_every_backend(worlds, backend):
    same_with_and_without_prefetch(worlds(2, backend))


# seconds of "compute" per unit, forward and backward: long beside a gather of 8x8 floats
NAP = 0.05


class Nap(torch.autograd.Function):
    """Compute that takes time (and lets the GIL go, as real kernels do), forward and backward."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(NAP)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(NAP)
        return g


class NapBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=F64)

    def forward(self, x):
        # the nap inside the unit's backward, before lin's
        return torch.tanh(Nap.apply(self.lin(x)))


def _trace(comm, prefetch: bool) -> list:
    from dplab.backends.nn.fsdp import FSDP

    torch.manual_seed(0)
    model = nn.Sequential(*(NapBlock() for _ in range(3)))
    more = {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"} if prefetch else {}
    fsdp = FSDP(model, comm, units=list(model), **more)
    x = torch.randn(4, 8, dtype=F64)
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        for _ in range(2):  # the first forward learns the order; the second prefetches by it
            fsdp(x).sum().backward()
    finally:
        comm.tracer.enabled = False
    return [
        (e.kind, e.thread, e.extra.get("unit"), e.t_start_ns, e.t_end_ns)
        for e in comm.tracer.take()
        if e.kind in ("unit_gather", "unit_forward", "unit_backward")
    ]


def overlaps(events: list, phase: str) -> set:
    """(computing unit, gathering unit) pairs: a comm-thread gather of one unit while another
    computed."""
    gathers = [e for e in events if e[0] == "unit_gather" and e[1] == "comm"]
    return {(k, j) for kind, thread, k, a, b in events if kind == phase and thread == "main"
            for _, _, j, c, d in gathers if j != k and c < b and a < d}


def test_prefetched_gathers_overlap_compute_in_the_trace(worlds):
    for rank, (ahead, plain) in enumerate(
        zip(worlds(2).run(_trace, True), worlds(2).run(_trace, False))
    ):
        # units 1..3 (the root, 0, holds nothing and spans the whole forward): unit k+1 gathers
        # while unit k runs forward, unit k-1 while unit k runs backward. Each pair overlaps
        # unless the loaded machine starts the comm thread a whole nap late: ask for one each
        forward = {(k, j) for k, j in overlaps(ahead, "unit_forward") if k}
        backward = overlaps(ahead, "unit_backward")
        assert forward and forward <= {(1, 2), (2, 3)}, (rank, ahead)
        assert backward and backward <= {(3, 2), (2, 1)}, (rank, ahead)
        assert not overlaps(plain, "unit_forward") and not overlaps(plain, "unit_backward")
        # without prefetch: no comm thread
        assert {e[1] for e in plain if e[0] == "unit_gather"} == {"main"}
