"""Lesson 11: mixed precision and loss scaling - half the bytes, and what it takes to train on them.

    dplab lesson 11

Five steps: what float16 can hold and where small gradients lose their bits; bfloat16's range
against float16's precision (why bfloat16 needs no loss scaling); float16 compute with
float32 master weights against plain float16; dynamic loss scaling skipping steps and backing off;
a float16 all-reduce sends half the bytes and rounds at every partial sum.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from dplab.backends import allreduce
from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.exercises import STUBS, check_file
from dplab.lessons.exercises.scaler import HINTS as SCALER_HINTS
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


@functools.lru_cache(maxsize=1)
def gradient_near_optimum():
    """A gradient of a model trained 600 steps: small entries."""
    adam = OptimConfig("adam", lr=0.01)
    cfg = TrainConfig(steps=600, global_batch=256, optimizer=adam)
    B = cfg.global_batch
    model, data, _ = setup(cfg)
    # a model near its optimum: small gradients
    params = train_single(cfg).params
    grad = np.zeros_like(params)
    idx = batch_indices(cfg.num_samples, B, step=0, seed=0)
    model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / B, grad)
    return grad


def what_float16_holds(lab):
    grad = gradient_near_optimum()
    tiny = FP16.smallest_normal
    small = grad[(grad != 0) & (np.abs(grad) < tiny)]
    scale = 2.0**16
    f16, f32 = np.float16, np.float32
    scaled = (small * scale).astype(f16).astype(f32) / scale
    return {"stored": FP16.nmant,
            "bits": FP16.nmant + 1,
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


def torch_scaler_defaults():
    """torch.amp.GradScaler's (init, growth, backoff, interval),
    or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    s = torch.amp.GradScaler("cpu")
    return (s._init_scale, s._growth_factor,
            s._backoff_factor, s._growth_interval)


def dynamic_scaling(lab):
    precision = MixedPrecision(init_scale=2.0**24, growth_interval=5)
    train = TrainConfig(steps=30, dtype="float32")
    spec = RunSpec(world_size=4, train=train, precision=precision)
    row, events = run_train(spec, world=lab.world(4), trace=True)
    scales = [e.extra for e in events[0] if e.kind == "loss_scale"]
    skipped = [e["step"] for e in scales if e["action"] == "skip"]
    first_kept = min(set(range(train.steps)) - set(skipped))
    later = [s for s in skipped if s > first_kept]   # overflows after a growth went too far
    grew_at = [e["step"] for e in scales if e["action"] == "growth"]
    then = next(e["scale"] for e in scales if e["step"] >= first_kept)
    defaults = MixedPrecision()
    return {"init": precision.init_scale,
            "d_init": defaults.init_scale,
            "d_growth": defaults.growth_factor,
            "d_backoff": defaults.backoff_factor,
            "d_interval": defaults.growth_interval,
            "torch_defaults": torch_scaler_defaults(),
            "skipped": len(skipped),
            "skipped_first": first_kept,
            "last_skip": first_kept - 1,
            "skipped_later": len(later),
            "later_after_growth": all(any(g < s for g in grew_at) for s in later),
            "later_steps": ", ".join(map(str, later)) or "none",
            "first_kept": first_kept,
            "scale_then": then,
            "grown": sum(e["action"] == "growth" for e in scales),
            "loss": row["final_loss"],
            "steps": train.steps,
            "interval": precision.growth_interval}


def to_bfloat16(x):
    """float32 -> bfloat16 -> float32 (numpy has no bfloat16: torch
    casts; without torch, keep float32's top 16 bits, rounded to
    nearest even, which is what bfloat16 is)."""
    try:
        import torch
    except ImportError:
        return bfloat16_by_bits(x)
    t = torch.from_numpy(np.asarray(x, dtype=np.float32))
    return t.to(torch.bfloat16).float().numpy()


def bfloat16_by_bits(x):
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    bits = bits.astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _bit_layout(facts):
    """Sign, exponent and fraction bits of the three formats, to scale."""
    from rich.text import Text
    out = Text()
    for name, exp, frac in (("float16", facts["exp16"], facts["frac16"]),
                            ("bfloat16", facts["exp_bf"], facts["frac_bf"]),
                            ("float32", 8, 23)):
        out.append(f"{name:>9} ", style="bold")
        out.append("S", style="magenta")
        out.append("E" * exp, style="cyan")
        out.append("F" * frac, style="yellow")
        out.append(f"  {exp} exponent, {frac} fraction bits\n")
    out.append("          S sign  E exponent: range  F fraction: precision", style="dim")
    return out


def worst(exact, rounded):
    return float(np.max(np.abs(rounded.astype(np.float64) - exact)
                        / np.abs(exact)))


def bfloat16_against_float16(lab):
    grad = gradient_near_optimum().astype(np.float32)
    g = grad[grad != 0]
    small = np.abs(g) < FP16.smallest_normal
    # the same gradient 1024x smaller: a larger batch's mean, later
    # in training (a power of two: bfloat16 rounds it identically)
    tinier = g / np.float32(1024)
    exact, exact_t = g.astype(np.float64), tinier.astype(np.float64)
    as16, as_bf = g.astype(np.float16), to_bfloat16(g)
    t16, t_bf = tinier.astype(np.float16), to_bfloat16(tinier)
    return {"exp16": 5, "exp_bf": 8, "frac16": FP16.nmant,
            "frac_bf": 7,
            "eps16": float(FP16.eps), "eps_bf": 2.0**-7,
            "max16": float(FP16.max),
            "max_bf": float(to_bfloat16(np.float32(3.39e38))),
            "tiny16": float(FP16.smallest_normal),
            "tiny_bf": float(np.finfo(np.float32).tiny),
            "small_share": float(small.mean()),
            "worst16": worst(exact[small], as16[small]),
            "worst_bf": worst(exact[small], as_bf[small]),
            "err16_big": worst_tenth(exact[~small], as16[~small]),
            "errbf_big": worst_tenth(exact[~small], as_bf[~small]),
            "zeros16": float(np.mean(t16 == 0)),
            "zeros_bf": float(np.mean(t_bf == 0)),
            "worst_bf_tinier": worst(exact_t, t_bf),
            "scaled_same": bool(np.array_equal(t_bf * 1024, as_bf)),
            "same_bits": bool(np.array_equal(as_bf, bfloat16_by_bits(g))),
            "needs_scaling": "float16"}


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


def scaler_exercise(lab):
    # what `dplab lesson check 11` says of the stub
    stub = check_file("loss_scaler", STUBS / "loss_scaler.py")
    return {"stub_passed": stub.passed, "stub_says": stub.message,
            "interval": 3, "after": 1.0}


STEPS = (
    Step(
        title="What float16 can hold",
        text=("float16 stores {stored} bits of fraction; with the leading 1 that every normal number has "
              "and does not store, that is {bits} significant bits: a relative step (machine epsilon, "
              "2^-{stored}) of {eps:.1e}. Its 5 exponent bits allow nothing above {max:,.0f}, and below "
              "{tiny:.1e} numbers lose bits (subnormals) until they flush to zero. "
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
                      lambda f: f["largest"] * f["scale"] < f["max"]),
                Check("10 stored bits + 1 implicit = 11 significant bits; epsilon is 2^-10",
                      lambda f: f["stored"] == 10 and f["bits"] == 11 and f["eps"] == 2.0**-10)),
        predict=Predict("What is the largest finite number float16 can hold?", "max", rel_tol=1e-4,
                        misconceptions=((65536, "2^16 would need one more exponent or fraction bit: the "
                                         "largest is (2 - 2^-10) x 2^15"),
                                        (32768, "the top exponent is 15, but the fraction adds almost "
                                         "another factor of two"))),
        hint="5 exponent bits: the largest exponent is 15, and 2^15 × (2 - 2^-10) = 65,504.",
        try_this="python -c \"import numpy as np; print(np.finfo(np.float16))\"",
        teaches=("precision",),
    ),
    Step(
        title="bfloat16: float32's range, fewer bits",
        text=("bfloat16 spends its 16 bits differently: {exp_bf} exponent bits (float32's) and {frac_bf} "
              "stored fraction bits, against float16's {exp16} and {frac16}. So its range is float32's "
              "(largest {max_bf:.2e}, smallest normal {tiny_bf:.1e}, against {max16:,.0f} and {tiny16:.1e}) "
              "and its precision 8x coarser (epsilon {eps_bf:.1e} against {eps16:.1e}). Cast without any "
              "loss scale, the same gradient near its optimum: the larger entries keep their value to "
              "{errbf_big:.1e} in bfloat16 (one in ten worse), {err16_big:.1e} in float16; but of the "
              "{small_share:.0%} below float16's normal range the worst is off by **{worst16:.1e}** in "
              "float16 and only {worst_bf:.1e} in bfloat16, which holds every value to half its epsilon. "
              "Make the gradient 1,024x smaller (a larger batch's mean, later in training): float16 "
              "flushes **{zeros16:.0%}** of it to zero, bfloat16 {zeros_bf:.0%}, rounding it exactly as "
              "before ({scaled_same}).\n\n"
              "Range, not precision, is what small gradients need, and a loss scale only moves values along "
              "the range: so bfloat16 training (TPUs, GPUs since the A100) usually runs with no loss "
              "scaling, while float16 needs it. numpy has no bfloat16: torch casts here (a float32 with its "
              "low 16 bits rounded off to nearest even gives the same bits: {same_bits})."),
        run=bfloat16_against_float16,
        picture=_bit_layout,
        checks=(Check("unscaled, float16's worst small entry is 5x worse than bfloat16's",
                      lambda f: f["worst16"] > 5 * f["worst_bf"]),
                Check("bfloat16 holds every small value to half its epsilon (2^-8)",
                      lambda f: f["worst_bf"] <= 2.0**-8 and f["worst_bf_tinier"] <= 2.0**-8),
                Check("1,024x smaller: float16 flushes a tenth or more to zero, bfloat16 nothing",
                      lambda f: f["zeros16"] >= 0.1 and f["zeros_bf"] == 0 and f["scaled_same"]),
                Check("on entries float16 holds normally, bfloat16 is coarser",
                      lambda f: f["errbf_big"] > 2 * f["err16_big"]),
                Check("torch's cast and the 16-bit rounding agree bit for bit", lambda f: f["same_bits"])),
        inputs={"exp_bf": 8, "exp16": 5},
        predict=Predict("bfloat16 has {exp_bf} exponent bits, float16 {exp16}. Which one needs loss scaling "
                        "to keep small gradients: 'float16' or 'bfloat16'?", "needs_scaling",
                        choices=("float16", "bfloat16"),
                        misconceptions=(("bfloat16", "bfloat16 has fewer fraction bits, but loss scaling "
                                         "fixes range, not precision: multiplying by S cannot add bits"),)),
        hint="Loss scaling moves values up the exponent range; which format runs out of exponent first?",
        hints=("float16's smallest normal is 6.1e-5; bfloat16's is float32's, 1.2e-38.",),
        try_this="python -c \"import torch; print(torch.finfo(torch.bfloat16), torch.finfo(torch.float16))\"",
        teaches=("precision", "bf16"),
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
        show=("dplab.reference.precision.scaler.compute_copy",),
        try_this="dplab train --world-size 4 --mixed-precision fp16 --dtype float32",
        teaches=("precision",),
    ),
    Step(
        title="Dynamic loss scaling: skip, back off, grow",
        text=("torch's `GradScaler` (and `MixedPrecision()` here) starts at S = 2^16 = {d_init:,.0f}, "
              "halves it (x{d_backoff}) on every overflow, skipping that step, and doubles it (x{d_growth}) "
              "after {d_interval:,} steps in a row without one. To see all of it in {steps} steps, this run "
              "starts with too large a scale, S = {init:,.0f}, and grows every {interval} steps: the "
              "scaled gradient overflows float16 (inf), so the step is **skipped** and S halved. Steps "
              "0 to {last_skip} are skipped, {skipped_first} halvings, and the first step taken is step "
              "{first_kept}, at S = {scale_then:,.0f}. Every {interval} steps without an overflow S doubles "
              "again ({grown} times here), probing for the largest scale that fits; a doubling that goes "
              "too far overflows and is skipped too (steps {later_steps}), so {skipped} steps were skipped "
              "in all. The run still trains: loss {loss:.3f} after "
              "{steps} steps."),
        run=dynamic_scaling,
        checks=(Check("steps are skipped while the scale is too large", lambda f: f["skipped"] > 0),
                Check("the first step taken runs at a scale halved once per skip before it",
                      lambda f: f["scale_then"] == f["init"] / 2 ** f["first_kept"]),
                Check("the scale grows again after clean steps", lambda f: f["grown"] > 0),
                Check("the later skips come after a doubling, and with the first ones make all of them",
                      lambda f: f["later_after_growth"]
                      and f["skipped"] == f["skipped_first"] + f["skipped_later"]),
                Check("the defaults are GradScaler's: 2^16, x2, x0.5, every 2,000 steps (torch's own, "
                      "where torch is installed)",
                      lambda f: (f["d_init"], f["d_growth"], f["d_backoff"], f["d_interval"])
                      == (2.0**16, 2.0, 0.5, 2000)
                      and f["torch_defaults"] in (None, (2.0**16, 2.0, 0.5, 2000)))),
        hint="The skip decision is one all-reduced flag: every rank skips the same steps.",
        show=("dplab.reference.precision.scaler.LossScaler.unscale_and_check",),
        try_this="dplab train --mixed-precision fp16 --dtype float32 --loss-scale 1024   # static",
        teaches=("precision",),
    ),
    Step(
        title="Half the bytes on the wire, and a rounding at every sum",
        text=("A ring all-reduce of {n:,} values on {p} ranks: rank 0 sends **{sent16:,}** bytes in "
              "float16 against {sent32:,} in float32. The price: each of the p-1 partial sums is rounded "
              "to float16, so the result is up to {err16:.2g} from the exact sum (float32: {err32:.1g}), "
              "every element within the bound (p-1)·u·Σ|x| with u = 2^-11: {within}."),
        run=half_the_bytes,
        checks=(Check("float16 sends exactly half the bytes of float32",
                      lambda f: 2 * f["sent16"] == f["sent32"]),
                Check("every element's error stays within the rounding bound", lambda f: f["within"]),
                Check("and float16's error is far larger than float32's",
                      lambda f: f["err16"] > 100 * f["err32"])),
        inputs={"n": 1_000_000, "p": 4},
        predict=Predict("A ring all-reduce of {n:,} float16 values at p={p}: how many bytes does rank 0 "
                        "send?", "sent16",
                        misconceptions=((1_500_000, "that is the reduce-scatter alone; the all-gather "
                                         "sends as much again"),
                                        (6_000_000, "that is float32: 4 bytes a value; float16 is 2"),
                                        (2_000_000, "that is the whole buffer once; the ring sends "
                                         "2(p-1)/p of it"))),
        show=("dplab.reference.algorithms.ring.allreduce",),
        hint="The ring sends 2(p-1)/p of the buffer from every rank, whatever the dtype; float16 is 2 bytes.",
        try_this="dplab train --world-size 4 --mixed-precision fp16 --dtype float32 --reduce-dtype float16",
        teaches=("precision", "allreduce"),
    ),
    Step(
        title="Exercise: the dynamic loss scaler's rule",
        text=("Write the rule of step 4 yourself. `dplab lesson init DIR` copies the stubs; fill in "
              "`update(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval)` in "
              "DIR/loss_scaler.py, returning `(new_scale, new_good_steps, take_step)`, and run "
              "`dplab lesson check 11 DIR`. It runs your rule through scripted overflows and through runs "
              "whose overflows come from the scale itself (a gradient overflows float16 once its largest "
              "entry times S passes 65,504), GradScaler's defaults over 4,100 steps among them, and holds "
              "every step to the engine's `LossScaler`. The stub never changes the scale and takes every "
              "step; checked as shipped it says:\n\n> {stub_says}"),
        run=scaler_exercise,
        checks=(Check("the stub fails its check, naming the growth it missed",
                      lambda f: not f["stub_passed"] and "should grow" in f["stub_says"]),),
        inputs={"interval": 3},
        predict=Predict("growth_interval {interval}: the scale grows, then the very next step overflows, "
                        "then two clean steps follow. By what factor has the scale changed after those "
                        "four steps, from where it started?", "after", rel_tol=1e-9, unit="x",
                        misconceptions=((2.0, "the overflow halves the grown scale: x2, then x0.5"),
                                        (4.0, "two clean steps after an overflow are not three: the "
                                         "count restarts at 0, so no growth yet"),
                                        (0.5, "the growth came first: x2, then x0.5"))),
        hint=SCALER_HINTS[0],
        hints=SCALER_HINTS[1:],
        show=("dplab.reference.precision.config.MixedPrecision",),
        try_this="dplab lesson init ex && dplab lesson check 11 ex   # edit ex/loss_scaler.py till it passes",
        exercise="loss_scaler",
        teaches=("precision",),
    ),
)

LESSON = Lesson(11, "precision", "Mixed precision and loss scaling",
                "How float16 halves the bytes, and what float32 masters and loss scaling add to train on it.",
                STEPS)
