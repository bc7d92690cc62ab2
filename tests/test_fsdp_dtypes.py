"""FSDP's wire dtypes: the gather in the compute dtype, the reduce-scatter in ``reduce_dtype``.

Bytes are counted from the trace (every ``send`` event inside an ``allgather`` or
``reduce_scatter`` span) and must be exactly what the schedules send
(``zero.traffic.collective_sent``) times the dtype's size: a bf16 gather sends half an fp32
one's bytes, and with a 16-bit ``reduce_dtype`` the whole step does. The gathered weights are
the same bits as gathering fp32 and casting after. A reduction in float16/bfloat16 must land
within Higham's bound of the exact (float64) sum of the ranks' weighted, cast gradients.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from test_fsdp import SEED, batch, loss_sum, make_model, units_of  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.schedule import chunk_bounds  # noqa: E402
from dplab.reference.zero.traffic import collective_sent  # noqa: E402

pytestmark = pytest.mark.torch
F32, B = torch.float32, 12
BF16, FP16 = torch.bfloat16, torch.float16
UNIT_ROUNDOFF = {FP16: 2.0 ** -11, BF16: 2.0 ** -8}


def half_reduce(backend: str) -> torch.dtype:
    """The 16-bit reduce dtype a backend adds: bfloat16 on torch, float16 on local and MPI."""
    return BF16 if backend == "torch" else FP16


def _bytes(comm, kind: str, config: str, compute, reduce) -> dict:
    """One training step's bytes sent by this rank, per collective, and what the schedules say."""
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_model(kind, SEED, F32)
    more = {} if reduce is None else {"reduce_dtype": reduce}
    fsdp = FSDP(model, comm, units=units_of(model, config), compute_dtype=compute, **more)
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    x, y = batch(kind, 0, B, F32)
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        (loss_sum(kind, fsdp(x[lo:hi]), y[lo:hi]) / (hi - lo)).backward()
    finally:
        comm.tracer.enabled = False
    events = comm.tracer.take()
    sent = {"allgather": 0, "reduce_scatter": 0}
    spans = [e for e in events if e.kind in sent]
    for e in events:
        if e.kind == "send":
            (span,) = [s for s in spans if s.t_start_ns <= e.t_start_ns <= s.t_end_ns]
            sent[span.kind] += e.bytes
    p, r = comm.world_size, comm.rank
    flats = [f for fl in fsdp.units for f in fl]
    cbytes = (compute or F32).itemsize
    rbytes = (reduce or F32).itemsize
    want = {
        "allgather": sum(
            2 * collective_sent("allgather", "ring", p, r, f.n) * cbytes for f in flats
        ),
        "reduce_scatter": sum(
            collective_sent("reduce_scatter", "ring", p, r, f.n) * rbytes
            for f in flats
            if f.trainable
        ),
    }
    return {"sent": sent, "want": want, "params": sum(f.n for f in flats),
            "spans": sorted(s.kind for s in spans)}


def measure(world, kind: str, config: str, reduce16) -> dict:
    """Bytes per step and rank for fp32, bf16 compute, bf16 compute + 16-bit reduce."""
    out = {}
    for name, compute, reduce in [
        ("fp32", None, None),
        ("bf16", BF16, None),
        ("bf16+r16", BF16, reduce16),
    ]:
        rows = world.run(_bytes, kind, config, compute, reduce)
        for r in rows:
            assert r["sent"] == r["want"], (name, r)  # the trace is exactly the schedules' bytes
        out[name] = [r["sent"] for r in rows]
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
def test_bytes_per_step_halve_in_the_compute_dtype(worlds, p):
    for kind, config in [("stack", "stack"), ("frozen", "frozen3")]:  # frozen3: a frozen flat too
        got = measure(worlds(p), kind, config, FP16)
        for fp32, bf16, both in zip(got["fp32"], got["bf16"], got["bf16+r16"]):
            assert fp32["allgather"] > 0 and fp32["reduce_scatter"] > 0
            assert 2 * bf16["allgather"] == fp32["allgather"]  # the gather halves ...
            # ... the fp32 reduction does not
            assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
            # with a 16-bit reduce, the whole step
            assert 2 * sum(both.values()) == sum(fp32.values())


def test_bytes_per_step_on_every_backend(worlds, backend):
    got = measure(worlds(3, backend), "stack", "stack", half_reduce(backend))
    for fp32, bf16, both in zip(got["fp32"], got["bf16"], got["bf16+r16"]):
        assert 2 * bf16["allgather"] == fp32["allgather"] and 2 * sum(both.values()) == sum(
            fp32.values()
        )


def _gathered_bits(comm, compute) -> list:
    """The weights a unit's forward sees (the gathered leaf) and the fp32 masters cast after."""
    from dplab.backends.nn.fsdp import FSDP

    model = make_model("stack", SEED + comm.rank, F32)
    fsdp = FSDP(model, comm, units=units_of(model, "stack"), compute_dtype=compute)
    seen = {}
    for i, b in enumerate(model.blocks):  # registered after FSDP's pre-hook: runs after the gather
        b.register_forward_pre_hook(
            lambda m, _a, i=i: seen.setdefault(i, m.weight.detach().clone())
        )
    fsdp(batch("stack", 0, 4, F32)[0])
    masters = fsdp.full_state_dict()
    return [(seen[i].dtype == compute and torch.equal(seen[i].view(torch.int16),
                                                      masters[f"blocks.{i}.weight"].to(compute).view(torch.int16)))
            for i in range(len(model.blocks))]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_gathered_weights_are_the_masters_cast_bit_for_bit(worlds, backend, name):
    compute = {"bf16": BF16, "fp16": FP16}[name]
    for r in worlds(3, backend).run(_gathered_bits, compute):
        assert r == [True] * 4


def _every_bf16(comm) -> bool:
    """All 65536 bfloat16 bit patterns (NaNs with payloads, infinities, subnormals) through the
    gather, each rank contributing its chunk: they arrive unchanged."""
    from dplab.backends.nn.fsdp_flat import _buf
    from dplab.reference.collectives import allgather

    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    t = torch.zeros(bits.numel(), dtype=BF16)
    lo, hi = chunk_bounds(t.numel(), comm.world_size)[comm.rank]
    t.view(torch.int16)[lo:hi] = bits[lo:hi]
    allgather(comm, _buf(t, copy_only=True), "ring")
    return torch.equal(t.view(torch.int16), bits)


def test_every_bfloat16_bit_pattern_survives_the_gather(worlds, backend):
    assert worlds(3, backend).run(_every_bf16) == [True] * 3


# -- reduce_dtype -------------------------------------------------------------------------------

def _reduced(comm, compute, reduce) -> list:
    """One backward: each trainable flat's reduced gradient chunk (float64) and its keys."""
    from dplab.backends.nn.fsdp import FSDP

    torch.set_num_threads(1)
    model = make_model("frozen", SEED, F32)
    fsdp = FSDP(
        model, comm, units=units_of(model, "frozen3"), compute_dtype=compute, reduce_dtype=reduce
    )
    lo, hi = chunk_bounds(B, comm.world_size)[comm.rank]
    x, y = batch("frozen", 0, B, F32)
    (loss_sum("frozen", fsdp(x[lo:hi]), y[lo:hi]) / (hi - lo)).backward()
    flats = [f for fl in fsdp.units for f in fl]
    return [(keys, f.shard.grad.dtype == F32, f.shard.grad.to(torch.float64).numpy().copy())
            for f, keys in zip(flats, fsdp._flat_keys) if f.trainable]


def sent_gradients(p: int, compute, reduce) -> dict:
    """Each rank's contribution as FSDP sends it: the compute-dtype gradient of its shard's mean
    loss, cast to fp32, times 1/p, cast to ``reduce`` (float64 arrays, one per parameter key)."""
    torch.set_num_threads(1)
    master = make_model("frozen", SEED, F32)
    x, y = batch("frozen", 0, B, F32)
    out = []
    for lo, hi in chunk_bounds(B, p):
        low = copy.deepcopy(master).to(compute)
        (loss_sum("frozen", low(x[lo:hi].to(compute)), y[lo:hi]) / (hi - lo)).backward()
        out.append({k: q.grad.reshape(-1).to(F32).mul_(1 / p).to(reduce).to(torch.float64).numpy()
                    for k, q in low.named_parameters() if q.grad is not None})
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_a_float16_reduction_is_within_higham_bound_of_the_exact_sum(worlds, p):
    check_reduction(worlds(p), p, BF16, FP16)


def test_reduce_dtype_on_every_backend(worlds, backend):
    check_reduction(worlds(3, backend), 3, BF16, half_reduce(backend))
    check_reduction(worlds(3, backend), 3, FP16, FP16)


def check_reduction(world, p: int, compute, reduce) -> None:
    sent = sent_gradients(p, compute, reduce)
    u = UNIT_ROUNDOFF[reduce]
    gamma = (p - 1) * u / (1 - (p - 1) * u)
    rows = world.run(_reduced, compute, reduce)
    exacts = []
    for i, (keys, *_) in enumerate(rows[0]):
        got = np.concatenate([r[i][2] for r in rows])  # rank r holds chunk r of the flat
        parts = [np.concatenate([s[k] for k in keys]) for s in sent]
        exact, bound = np.sum(parts, axis=0), gamma * np.sum(np.abs(parts), axis=0)
        assert all(r[i][1] for r in rows), "shard.grad stays in the master dtype"
        assert np.all(np.abs(got - exact) <= bound), (keys, np.max(np.abs(got - exact) - bound))
        low = torch.from_numpy(got).to(reduce).to(torch.float64).numpy()
        # every value a float16 (bf16): summed in reduce_dtype
        np.testing.assert_array_equal(got, low)
        exacts.append(exact)
    if p > 1:
        # the exact sums are not all 16-bit numbers: so the check above can tell fp32 from fp16 sums
        exact = np.concatenate(exacts)
        assert not np.array_equal(exact, torch.from_numpy(exact).to(reduce).double().numpy())


def _refused(comm) -> str:
    from dplab.backends.nn.fsdp import FSDP

    try:
        FSDP(make_model("stack", 0, F32), comm, compute_dtype=BF16, reduce_dtype=BF16)
    except ConfigError as e:
        return str(e)
    return "built"


def test_a_bfloat16_reduction_is_refused_where_numpy_carries_it(worlds, backend):
    for msg in worlds(2, backend).run(_refused):
        if backend == "torch":
            assert msg == "built"
        else:  # every rank refuses at construction: none waits in a collective
            assert f"on the {backend} backend" in msg and "reduce_dtype=torch.float16" in msg
            assert "backend='torch'" in msg


def _bad_reduce(comm) -> str:
    from dplab.backends.nn.fsdp import FSDP

    try:
        FSDP(make_model("stack", 0, F32), comm, reduce_dtype=torch.int32)
    except ConfigError as e:
        return str(e)
    return "built"


def test_bad_reduce_dtype_says_what_to_do(worlds):
    assert "reduce_dtype must be one of" in worlds(1).run(_bad_reduce)[0]


def _peak(comm, compute) -> dict:
    from dplab.backends.nn.fsdp import FSDP

    model = make_model("stack", SEED, F32)
    fsdp = FSDP(model, comm, units=units_of(model, "stack"), compute_dtype=compute)
    x, y = batch("stack", 0, B, F32)
    fsdp.reset_peak_memory()
    loss_sum("stack", fsdp(x), y).backward()
    return fsdp.param_memory()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_a_16_bit_gather_needs_no_fp32_copy(worlds, name):
    """Gathered parameters at their peak: the root (34 params) and one block (272), in 2 bytes each;
    gathering fp32 and casting after also held the block's fp32 copy (1700 bytes, not 612)."""
    r = worlds(2).run(_peak, {"bf16": BF16, "fp16": FP16}[name])[0]
    assert r["gathered_peak_bytes"] == (34 + 272) * 2 == 612
    assert r["shard_bytes"] == (17 + 4 * 136) * 4 and r["held_grad_bytes"] == 0
