"""FSDP beyond plain training: mixed precision, full parameters, memory per rank, bad units.

Mixed precision is checked against one process that applies the same casts: per rank's shard
of the batch, a bf16 (fp16) copy of the fp32 masters computes the gradient, which is cast to
fp32, weighted 1/p and summed; the fp32 masters step on that. FSDP must match it within fp32
rounding (the sums run in another order), and be far from plain fp32 training (the casts
matter, so the check can tell). Memory: the parameter bytes alive per rank, counted by FSDP
and sampled independently from the leaves' real storage during forward and backward.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from tiers import engines

torch = pytest.importorskip("torch")
from test_fsdp import SEED, batch, loss_sum, make_model, numpy_state, rel, units_of  # noqa: E402
from torch import nn  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
F32, STEPS, B = torch.float32, 3, 12
# fp32 rounding: the ranks' gradients are summed in another order than one process sums them
TOL = 2e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cast_reference(kind: str, p: int, dtype: torch.dtype | None) -> dict:
    """One process, fp32 masters; per shard a ``dtype`` copy computes the gradient (None: fp32
    only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same kernels, the same roundings
    try:
        master = make_model(kind, SEED, F32)
        opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = batch(kind, step, B, F32)
            opt.zero_grad()
            if dtype is None:
                (loss_sum(kind, master(x), y) / B).backward()
            else:
                for lo, hi in chunk_bounds(B, p):
                    # params and float buffers, as FSDP casts them
                    low = copy.deepcopy(master).to(dtype)
                    xs = x[lo:hi].to(dtype) if x.is_floating_point() else x[lo:hi]
                    (loss_sum(kind, low(xs), y[lo:hi]) / (hi - lo)).backward()
                    for m, q in zip(master.parameters(), low.parameters()):
                        if q.grad is not None:
                            g = q.grad.to(F32) / p
                            m.grad = g if m.grad is None else m.grad + g
            opt.step()
        return numpy_state(master.state_dict())
    finally:
        torch.set_num_threads(threads)


def _train_mixed(comm, kind: str, config: str, dtype: torch.dtype) -> tuple[dict, list]:
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_model(kind, SEED + comm.rank, F32)
    fsdp = FSDP(model, comm, units=units_of(model, config), compute_dtype=dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    seen = []
    for step in range(STEPS):
        x, y = batch(kind, step, B, F32)
        opt.zero_grad()
        out = fsdp(x[lo:hi])
        seen.append(str(out.dtype))
        (loss_sum(kind, out, y[lo:hi]) / (hi - lo)).backward()
        shards = list(fsdp.parameters())
        grads = {str(q.grad.dtype) for q in shards if q.grad is not None}
        seen.append(sorted({str(q.dtype) for q in shards} | grads))
        opt.step()
    return numpy_state(fsdp.full_state_dict()), seen


@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_compute_dtype_equals_one_process_with_the_same_casts(worlds, p, name):
    dtype = DTYPES[name]
    for kind, config in [("frozen", "frozen2"), ("tied", "tied_head")]:
        want, fp32 = cast_reference(kind, p, dtype), cast_reference(kind, p, None)
        for state, seen in worlds(p).run(_train_mixed, kind, config, dtype):
            # bf16 compute, fp32 shards
            assert seen[0] == str(dtype) and seen[1] == ["torch.float32"], seen
            assert (
                state.keys() == want.keys()
                and state[
                    "out.weight" if kind == "frozen" else "mid.weight"
                    # numpy_state's widening
                ].dtype
                == np.float64
            )
            for key in want:
                assert rel(state[key], want[key]) <= TOL, f"{kind} {name} p={p} {key}"
            assert max(rel(state[k], fp32[k]) for k in want) > 20 * TOL, (
                "the casts changed nothing: no test"
            )


def test_compute_dtype_on_every_backend(worlds, backend):
    want = cast_reference("frozen", 3, torch.bfloat16)
    for state, _ in worlds(3, backend).run(_train_mixed, "frozen", "frozen3", torch.bfloat16):
        assert max(rel(state[k], want[k]) for k in want) <= TOL


# -- full parameters ------------------------------------------------------------------------

def _summon(comm) -> dict:
    from dplab.backends.nn.fsdp import FSDP

    model = make_model("tied", SEED + comm.rank)
    fsdp = FSDP(model, comm, units=units_of(model, "tied_head"))
    out = {"start": numpy_state(fsdp.full_state_dict())}
    with fsdp.summon_full_params():
        out["shapes"] = [tuple(model.head.weight.shape), tuple(model.mid.bias.shape)]
        out["tied"] = model.head.weight.data_ptr() == model.emb.weight.data_ptr()
        model.mid.weight.mul_(2)
        model.emb.weight.add_(1)  # through one holder: the tied weight is one tensor
    out["written"] = numpy_state(fsdp.full_state_dict())
    with fsdp.summon_full_params(writeback=False):
        model.mid.weight.zero_()
    out["not_written"] = numpy_state(fsdp.full_state_dict())
    plain = make_model("tied", 999)
    plain.load_state_dict(fsdp.full_state_dict())
    x, _ = batch("tied", 0)
    out["same_output"] = torch.equal(plain(x), fsdp(x))
    fsdp.load_full_state_dict(make_model("tied", 555).state_dict())
    out["loaded"] = numpy_state(fsdp.full_state_dict())
    try:
        with fsdp.summon_full_params():
            fsdp(x)
    except ConfigError as e:
        out["forward_inside"] = str(e)
    out["leaf_bytes"] = sum(f.leaf.untyped_storage().nbytes() for fl in fsdp.units for f in fl)
    return out


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 3]), indirect=["backend"])
def test_summon_full_params_and_full_state_dict(worlds, backend, p):
    init = numpy_state(make_model("tied", SEED).state_dict())
    other = numpy_state(make_model("tied", 555).state_dict())
    for r in worlds(p, backend).run(_summon):
        assert r["shapes"] == [(11, 6), (6,)] and r["tied"]
        assert all(np.array_equal(r["start"][k], init[k]) for k in init)  # rank 0's, on every rank
        np.testing.assert_array_equal(r["written"]["mid.weight"], 2 * init["mid.weight"])
        np.testing.assert_array_equal(r["written"]["emb.weight"], init["emb.weight"] + 1)
        np.testing.assert_array_equal(r["written"]["head.weight"], init["emb.weight"] + 1)
        assert all(np.array_equal(r["not_written"][k], r["written"][k]) for k in init)
        assert r["same_output"]
        assert all(np.array_equal(r["loaded"][k], other[k]) for k in other)
        assert "summon_full_params" in r["forward_inside"] and r["leaf_bytes"] == 0


# -- memory ---------------------------------------------------------------------------------

def _memory(comm) -> dict:
    """One training step of the 4-block stack; FSDP's count, and the leaves' real storage sampled
    at every block's forward (after its gather) and at every gradient hook."""
    from dplab.backends.nn.fsdp import FSDP

    model = make_model("stack", SEED)
    fsdp = FSDP(model, comm, units=units_of(model, "stack"))
    flats = [f for fl in fsdp.units for f in fl]
    samples = []

    def sample(*_):
        samples.append(sum(f.leaf.untyped_storage().nbytes() for f in flats))

    for b in model.blocks:
        b.register_forward_pre_hook(sample)
        b.register_forward_hook(sample)
    for f in flats:  # after FSDP's own hook (registered first): the unit's reduce and free are done
        f.leaf.register_post_accumulate_grad_hook(sample)
    x, y = batch("stack", 0, B)
    fsdp.reset_peak_memory()
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss_sum("stack", fsdp(x), y).backward()
        opt.step()
    return {**fsdp.param_memory(), "sampled_peak": max(samples), "samples": len(samples),
            "unit_bytes": [f.n * 8 for f in flats]}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_peak_parameter_memory_is_shards_plus_units_in_flight(worlds, p):
    r = worlds(p).run(_memory)[0]
    root, *blocks = r["unit_bytes"]  # the root holds the head (34 params), each block 272
    assert root == 34 * 8 and blocks == [272 * 8] * 4
    assert r["unsharded_bytes"] == root + sum(blocks) == 8976
    rank0 = [chunk_bounds(n, p)[0] for n in (34, *[272] * 4)]
    assert r["shard_bytes"] == sum(8 * (hi - lo) for lo, hi in rank0)
    assert r["gathered_peak_bytes"] == root + blocks[0]  # the root and one block, never two blocks
    assert r["sampled_peak"] == r["gathered_peak_bytes"] and r["samples"] == 2 * (8 + 5)
    assert r["peak_bytes"] == r["shard_bytes"] + r["gathered_peak_bytes"]
    if p > 1:
        assert r["peak_bytes"] < r["unsharded_bytes"]


# -- configuration errors -------------------------------------------------------------------

def _bad(comm, what: str) -> str:
    from dplab.backends.nn.fsdp import FSDP, MixedPrecision

    model = make_model("stack", 0)
    args = {
        "outside": {"units": [nn.Linear(2, 2)]},
        "twice": {"units": [model.blocks[0], model.blocks[0]]},
        "nested": {"units": [model.blocks, model.blocks[1]]},
        "root": {"units": [model]},
        "algorithm": {"algorithm": "tree"},
        "dtype": {"compute_dtype": torch.int8},
        "prefetch": {"backward_prefetch": "BACKWARD_POST"},
        "policy_key": {
            "units": [model.blocks[0]],
            "mixed_precision": {model.blocks[1]: MixedPrecision()},
        },
        "both": {"compute_dtype": torch.bfloat16, "mixed_precision": MixedPrecision()},
        "buffer": {"mixed_precision": MixedPrecision(buffer_dtype=torch.int8)},
    }[what]
    try:
        FSDP(model, comm, **args)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "what, needle",
    [
        ("outside", "not inside the wrapped module"),
        ("twice", "listed twice"),
        ("nested", "inside unit 'blocks'"),
        ("root", "always the root unit"),
        ("algorithm", "ring, direct"),
        ("dtype", "compute_dtype must be"),
        ("prefetch", "must be None or 'BACKWARD_PRE'"),
        ("policy_key", "not a unit"),
        ("both", "not both"),
        ("buffer", "buffer_dtype must be"),
    ],
)
def test_bad_configurations_say_what_to_do(worlds, what, needle):
    assert needle in worlds(1).run(_bad, what)[0]


# -- gradient accumulation, a unit without a gradient ---------------------------------------

def _accumulate(comm, micro: int) -> dict:
    """``micro`` backward passes per step (each loss / micro), then one step: the big batch's step.
    There is no no_sync: each backward reduce-scatters and adds into shard.grad."""
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_model("frozen", SEED + comm.rank)
    fsdp = FSDP(model, comm, units=units_of(model, "frozen3"))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.1)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    for step in range(STEPS):
        x, y = batch("frozen", step)
        opt.zero_grad()
        for a, b in chunk_bounds(hi - lo, micro):
            (loss_sum("frozen", fsdp(x[lo + a:lo + b]), y[lo + a:lo + b]) / (hi - lo)).backward()
        opt.step()
    return numpy_state(fsdp.full_state_dict())


@pytest.mark.parametrize("p", [1, 2, 3])
def test_accumulated_micro_batches_take_the_big_batch_step(worlds, p):
    from test_fsdp import reference

    want = reference("frozen")[-1]
    for state in worlds(p).run(_accumulate, 2):
        assert max(rel(state[k], want[k]) for k in want) <= 1e-10


class Spare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = (
            nn.Linear(3, 2, dtype=torch.float64),
            nn.Linear(3, 2, dtype=torch.float64),
        )

    def forward(self, x):
        self.spare(x)  # runs (so its unit is gathered and waits for a gradient) but feeds no loss
        return self.used(x)


def _spare(comm) -> list:
    """The spare unit gets no gradient: it reduces zeros at the end of backward; nobody waits."""
    from dplab.backends.nn.fsdp import FSDP

    torch.manual_seed(0)
    model = Spare()
    fsdp = FSDP(model, comm, units=[model.used, model.spare])
    x = torch.full((4, 3), comm.rank + 1.0, dtype=torch.float64)
    for _ in range(2):
        fsdp(x).sum().backward()
    return [f.shard.grad.numpy().copy() for fl in fsdp.units for f in fl]


def test_a_unit_without_gradient_reduces_zeros_and_the_world_goes_on(worlds):
    # 2 backwards x the rank mean of 4 rows of x (1s, 2s); bias: 4
    full = np.array([12.0] * 6 + [8.0] * 2)
    for rank, (used, spare) in enumerate(worlds(2).run(_spare)):  # the root holds nothing: 2 flats
        np.testing.assert_array_equal(used, full[4 * rank:4 * rank + 4])
        np.testing.assert_array_equal(spare, np.zeros(4))  # a gradient of zeros, not None
