"""Lesson 11: mixed precision and loss scaling - half the bytes, and what it takes to train on them.

    dplab lesson 11

Four steps: what float16 can hold and where small gradients lose their bits; float16 compute with
float32 master weights against plain float16; dynamic loss scaling skipping steps and backing off;
a float16 all-reduce sends half the bytes and rounds at every partial sum.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dplab.backends import allreduce
from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.data import batch_indices
from dplab.reference.optim import OptimConfig
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.train.single import TrainConfig, setup, train_single

__all__ = ["LESSON"]

FP16 = np.finfo(np.float16)


def worst_tenth(exact, rounded):
    """The 90th percentile of the relative error: one value in ten is
    off by more than this."""
    error = np.abs(rounded.astype(np.float64) - exact) / np.abs(exact)
    return float(np.percentile(error, 90))


def what_float16_holds(lab):
    adam = OptimConfig("adam", lr=0.01)
    cfg = TrainConfig(steps=600, global_batch=256, optimizer=adam)
    B = cfg.global_batch
    model, data, _ = setup(cfg)
    # a model near its optimum: small gradients
    params = train_single(cfg).params
    grad = np.zeros_like(params)
    idx = batch_indices(cfg.num_samples, B, step=0, seed=0)
    model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / B, grad)
    tiny = FP16.smallest_normal
    small = grad[(grad != 0) & (np.abs(grad) < tiny)]
    scale = 2.0**16
    f16, f32 = np.float16, np.float32
    scaled = (small * scale).astype(f16).astype(f32) / scale
    return {"bits": FP16.nmant + 1,
            "max": float(FP16.max),
            "eps": float(FP16.eps),
            "tiny": float(tiny),
            "below_normal": len(small) / np.count_nonzero(grad),
            "largest": float(np.abs(grad).max()),
            "err_plain": worst_tenth(small, small.astype(f16)),
            "err_scaled": worst_tenth(small, scaled),
            "scale": scale}


def pure_float16(cfg):
    """Weights, gradients and updates all in float16: no float32
    master copy."""
    model, data, params = setup(replace(cfg, dtype="float64"))
    params = params.astype(np.float16)
    lr, B = np.float16(cfg.optimizer.lr), cfg.global_batch
    for step in range(cfg.steps):
        idx = batch_indices(cfg.num_samples, B, step, cfg.seed)
        grad = np.zeros_like(params)
        x = data.x[idx].astype(np.float16)
        y = data.y[idx].astype(np.float16)
        model.loss_and_grad(params, x, y, 1 / B, grad)
        params -= lr * grad
    return params


def masters_in_float32(lab):
    cfg = TrainConfig(steps=50, dtype="float32")
    exact = train_single(replace(cfg, dtype="float64")).params
    errors = {}
    for name, precision in (("float32", None), ("mixed", MixedPrecision())):
        spec = RunSpec(world_size=4, train=cfg, precision=precision)
        row, _ = run_train(spec, world=lab.world(4))
        # the oracle here is float64
        errors[name] = row["max_abs_diff_vs_single"]
    half = pure_float16(cfg).astype(np.float64)
    errors["float16"] = float(np.abs(half - exact).max())
    return errors | {"steps": cfg.steps}


def dynamic_scaling(lab):
    precision = MixedPrecision(init_scale=2.0**24, growth_interval=5)
    train = TrainConfig(steps=30, dtype="float32")
    spec = RunSpec(world_size=4, train=train, precision=precision)
    row, events = run_train(spec, world=lab.world(4), trace=True)
    scales = [e.extra for e in events[0] if e.kind == "loss_scale"]
    skipped = [e["step"] for e in scales if e["action"] == "skip"]
    first_kept = min(set(range(train.steps)) - set(skipped))
    then = next(e["scale"] for e in scales if e["step"] >= first_kept)
    return {"init": precision.init_scale,
            "skipped": len(skipped),
            "first_kept": first_kept,
            "scale_then": then,
            "grown": sum(e["action"] == "growth" for e in scales),
            "loss": row["final_loss"],
            "steps": train.steps,
            "interval": precision.growth_interval}


def float16_values(rank, n):
    rng = np.random.default_rng(rank)
    return rng.standard_normal(n).astype(np.float16)


def allreduce_in(comm, n, dtype):
    x = float16_values(comm.rank, n).astype(dtype)
    comm.tracer.enabled = True
    allreduce(comm, x, algorithm="ring")
    comm.tracer.enabled = False
    sends = [e for e in comm.tracer.take() if e.kind == "send"]
    return x, sum(e.bytes for e in sends)


def half_the_bytes(lab):
    n, p = 1_000_000, 4
    values = [float16_values(r, n).astype(np.float64) for r in range(p)]
    exact = sum(values)
    magnitude = sum(np.abs(v) for v in values)
    results = {}
    for dtype in ("float16", "float32"):
        x, sent = lab.world(p).run(allreduce_in, n, dtype)[0]
        results[dtype] = (sent, np.abs(x.astype(np.float64) - exact))
    # float16's unit roundoff, 2^-11
    u = FP16.eps / 2
    sent16, err16 = results["float16"]
    sent32, err32 = results["float32"]
    bound = (p - 1) * u * magnitude * 1.01
    return {"n": n, "p": p,
            "sent16": sent16, "sent32": sent32,
            "err16": float(err16.max()),
            "err32": float(err32.max()),
            "within": bool(np.all(err16 <= bound))}


STEPS = (
    Step(
        title="What float16 can hold",
        text=("float16 has {bits} bits of mantissa: a relative precision of {eps:.1e}, nothing above "
              "{max:,.0f}, and below {tiny:.1e} numbers lose bits (subnormals) until they flush to zero. "
              "The gradients of a model near its optimum are small: **{below_normal:.0%}** of this one's "
              "entries lie below {tiny:.1e}; cast to float16, one in ten of those is off by more than "
              "**{err_plain:.1e}** of its value. Multiply the loss by S = {scale:,.0f} first (so every "
              "gradient is S times larger; the largest, {largest:.1e}, still fits), cast, then divide by S "
              "in float32: that error falls to {err_scaled:.1e}. The multiplication is **loss scaling**."),
        run=what_float16_holds,
        checks=(Check("a fair share of the gradient (> 10%) lies below float16's normal range",
                      lambda f: f["below_normal"] > 0.1),
                Check("scaling before the cast cuts their worst-tenth relative error more than fivefold",
                      lambda f: f["err_scaled"] < f["err_plain"] / 5),
                Check("and the scaled gradient still fits float16",
                      lambda f: f["largest"] * f["scale"] < f["max"])),
        predict=Predict("What is the largest finite number float16 can hold?", "max", rel_tol=1e-3),
        hint="5 exponent bits: the largest exponent is 15, and 2^15 × (2 - 2^-10) = 65,504.",
        try_this="python -c \"import numpy as np; print(np.finfo(np.float16))\"",
        teaches=("precision",),
    ),
    Step(
        title="Compute in float16, keep float32 masters",
        text=("Trained for {steps} steps on 4 ranks, against float64 on one device: plain float32 ends "
              "{float32:.1e} away; **mixed precision** (float16 forward and backward on a float16 copy of "
              "float32 master weights, the loss scaled, the update in float32) ends {mixed:.1e} away; "
              "everything in float16 - weights, gradients, updates - ends **{float16:.1e}** away. An "
              "update lr·g that is smaller than half a float16 step of the weight is rounded away: the "
              "master copy in float32 keeps those small steps."),
        run=masters_in_float32,
        checks=(Check("mixed precision ends more than 10x closer to float64 than pure float16",
                      lambda f: f["mixed"] * 10 < f["float16"]),
                Check("and float32 closer still", lambda f: f["float32"] < f["mixed"])),
        hint="reference/precision/amp.py: the five calls mixed precision adds to train_sync.",
        try_this="dplab train --world-size 4 --mixed-precision fp16 --dtype float32",
        teaches=("precision",),
    ),
    Step(
        title="Dynamic loss scaling: skip, back off, grow",
        text=("Start with too large a scale, S = {init:,.0f}: the scaled gradient overflows float16 "
              "(inf), so the step is **skipped** and S halved. After {skipped} skipped steps in all, "
              "the first step taken is step {first_kept}, at S = {scale_then:,.0f}. Every {interval} "
              "steps without an overflow S doubles again ({grown} times here), probing for the largest "
              "scale that fits - torch's GradScaler rules. The run still trains: loss {loss:.3f} after "
              "{steps} steps."),
        run=dynamic_scaling,
        checks=(Check("steps are skipped while the scale is too large", lambda f: f["skipped"] > 0),
                Check("the first step taken runs at a scale halved once per skip before it",
                      lambda f: f["scale_then"] == f["init"] / 2 ** f["first_kept"]),
                Check("the scale grows again after clean steps", lambda f: f["grown"] > 0)),
        hint="The skip decision is one all-reduced flag: every rank skips the same steps.",
        try_this="dplab train --mixed-precision fp16 --dtype float32 --loss-scale 1024   # static",
        teaches=("precision",),
    ),
    Step(
        title="Half the bytes on the wire, and a rounding at every sum",
        text=("A ring all-reduce of {n:,} values on {p} ranks: rank 0 sends **{sent16:,}** bytes in "
              "float16 against {sent32:,} in float32. The price: each of the p-1 partial sums is rounded "
              "to float16, so the result is up to {err16:.2g} from the exact sum (float32: {err32:.1g}), "
              "every element within the bound (p-1)·u·Σ|x| with u = 2^-11: `{within}`."),
        run=half_the_bytes,
        checks=(Check("float16 sends exactly half the bytes of float32",
                      lambda f: 2 * f["sent16"] == f["sent32"]),
                Check("every element's error stays within the rounding bound", lambda f: f["within"]),
                Check("and float16's error is far larger than float32's",
                      lambda f: f["err16"] > 100 * f["err32"])),
        predict=Predict("A ring all-reduce of {n:,} float16 values at p={p}: how many bytes does rank 0 "
                        "send?", "sent16"),
        hint="The ring sends 2(p-1)/p of the buffer from every rank, whatever the dtype; float16 is 2 bytes.",
        try_this="dplab train --world-size 4 --mixed-precision fp16 --dtype float32 --reduce-dtype float16",
        teaches=("precision", "allreduce"),
    ),
)

LESSON = Lesson(11, "precision", "Mixed precision and loss scaling",
                "How float16 halves the bytes, and what float32 masters and loss scaling add to train on it.",
                STEPS)
