"""Lesson 13: batch-size economics - what a larger global batch buys, and where it stops paying.

    dplab lesson 13

Data parallelism grows the global batch with the ranks (weak scaling, lesson 5). Six steps on
the spine's model and optimizers, one device standing in for p ranks (lesson 1: the same SGD):
the gradient noise scale from per-sample gradients (McCandlish et al. 2018); the critical batch,
where steps stop falling and samples start rising; where the linear lr rule breaks (Goyal et al.
2017); the generalisation gap on held-out data; why Adam scales its lr with the square root
of the batch; and ramping the batch up instead of decaying the lr (Smith et al. 2018).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dplab.lessons.l05_scaling import _bars
from dplab.lessons.l06_large_batches import (
    BASE_BATCH,
    BASE_LR,
    MODEL,
    N_HELD_OUT,
    N_TRAIN,
    split_data,
    train_minibatch,
)
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.data import batch_indices
from dplab.reference.lr import scaled_lr
from dplab.reference.model import MLP
from dplab.reference.optim import OptimConfig, make_optimizer

__all__ = ["LESSON", "per_sample_grads", "noise_scale"]

PROBE = 1024            # training samples whose per-sample gradients are taken
TARGET = 0.2            # held-out loss that step 2 trains to
BATCHES = (8, 32, 128, 512, 2048)


def per_sample_grads(model, params, x, y):
    """One gradient per sample: row i is the gradient of sample i's loss."""
    grads = np.zeros((len(x), model.num_params))
    for i in range(len(x)):
        model.loss_and_grad(params, x[i:i + 1], y[i:i + 1], 1.0, grads[i])
    return grads


def noise_scale(grads):
    """McCandlish et al.'s simple noise scale B_simple = tr(Σ) / |G|^2:
    the per-sample gradients' total variance over the squared length of
    their mean."""
    mean = grads.mean(axis=0)
    trace = ((grads - mean) ** 2).sum(axis=1).mean()
    return trace / (mean @ mean), trace, mean


def trained(steps, seed=0):
    """Parameters after ``steps`` steps of batch 32 (momentum SGD)."""
    model = MLP(MODEL)
    (x, y), _ = split_data(seed)
    params = model.init_params(seed)
    opt = make_optimizer(OptimConfig("momentum", lr=BASE_LR), model.num_params,
                         params.dtype, model.param_slices)
    grad = np.zeros_like(params)
    for step in range(steps):
        idx = batch_indices(N_TRAIN, BASE_BATCH, step, seed)
        grad[:] = 0
        model.loss_and_grad(params, x[idx], y[idx], 1 / BASE_BATCH, grad)
        opt.step(params, grad)
    return model, params


def _noise(lab):
    """B_simple at the start and after 200 steps (kept: step 2 compares)."""
    if "l13" not in lab.scratch:
        (x, y), _ = split_data()
        x, y = x[:PROBE], y[:PROBE]
        out = {}
        for steps in (0, 200):
            model, params = trained(steps)
            grads = per_sample_grads(model, params, x, y)
            loss = model.loss(model.forward(params, x), y, 1 / PROBE)
            out[steps] = (grads, float(loss))
        lab.scratch["l13"] = out
    return lab.scratch["l13"]


def gradient_noise(lab):
    points = _noise(lab)
    grads, loss = points[200]
    b_simple, trace, mean = noise_scale(grads)
    # a minibatch's gradient misses the mean by tr(Σ)/B on average
    rng, batch = np.random.default_rng(0), 16
    draws = [grads[rng.integers(0, PROBE, batch)].mean(axis=0)
             for _ in range(400)]
    miss = np.mean([((g - mean) ** 2).sum() for g in draws])
    start = noise_scale(points[0][0])[0]
    return {"probe": PROBE, "b_start": start, "b_simple": b_simple,
            "loss_start": points[0][1], "loss": loss, "trace": trace,
            "batch": batch, "miss": miss, "predicted": trace / batch,
            "rel": miss / (trace / batch),
            "grows": "larger" if b_simple > start else "smaller"}


def _b_simple(lab):
    return noise_scale(_noise(lab)[200][0])[0]


def steps_to(batch, lr, target=TARGET, cap=400, seed=0):
    """Steps of momentum SGD until the held-out loss reaches ``target``
    (None: not within ``cap`` steps, or diverged)."""
    model = MLP(MODEL)
    (x, y), (x_out, y_out) = split_data(seed)
    x_out, y_out = x_out[:512], y_out[:512]
    params = model.init_params(seed)
    opt = make_optimizer(OptimConfig("momentum", lr=lr), model.num_params,
                         params.dtype, model.param_slices)
    grad = np.zeros_like(params)
    start = None
    for step in range(cap):
        held_out = model.loss(model.forward(params, x_out), y_out, 1 / 512)
        start = start or held_out
        if held_out <= target:
            return step
        if not held_out < 2 * start:          # diverging
            return None
        idx = batch_indices(N_TRAIN, batch, step, seed)
        grad[:] = 0
        model.loss_and_grad(params, x[idx], y[idx], 1 / batch, grad)
        opt.step(params, grad)
    return None


def best_steps(batch, first_lr):
    """The fewest steps to the target over lrs first_lr x 2^i: each
    batch its own best lr (scanned upward until it gets worse)."""
    best = None
    for i in range(10):
        lr = first_lr * 2 ** i
        steps = steps_to(batch, lr)
        if steps is None and best is not None:
            break
        if steps is not None and (best is None or steps < best[0]):
            best = (steps, lr)
        elif best is not None:
            break
    return best


def critical_batch(lab):
    rows, lr = {}, 0.0125
    for b in BATCHES:
        # a larger batch's best lr is no smaller: start one below
        rows[b] = best_steps(b, lr)
        lr = rows[b][1] / 2
    steps = np.array([rows[b][0] for b in BATCHES], float)
    inv = 1 / np.array(BATCHES, float)
    # S(B) = S_min (1 + B_crit / B): a straight line in 1/B
    slope, s_min = np.polyfit(inv, steps, 1)
    b_crit = slope / s_min
    table = "\n".join(f"| {b:,} | {lr:g} | {s} | {s * b:,} |"
                      for b, (s, lr) in rows.items())
    b_simple = _b_simple(lab)
    last, before = rows[BATCHES[-1]][0], rows[BATCHES[-2]][0]
    return {"table": table, "target": TARGET, "steps": steps.tolist(),
            "samples": [rows[b][0] * b for b in BATCHES],
            "batches": list(BATCHES),
            "s_min": s_min, "b_crit": b_crit, "b_simple": b_simple,
            "ratio": b_crit / b_simple, "last_gain": before / max(last, 1),
            "first_gain": rows[BATCHES[0]][0] / rows[BATCHES[1]][0],
            "b_last": BATCHES[-1], "b_before": BATCHES[-2],
            "fewer": "about the same" if before < 2 * last else "4x fewer"}


HELD, BROKEN = 1.3, 2.0   # the linear rule holds while within 1.3x of k = 1; broken past 2x


def linear_rule_breaks(lab):
    epochs, rows = 8, {}
    for k in (1, 4, 16, 64, 128):
        batch = k * BASE_BATCH
        lr = scaled_lr(BASE_LR, BASE_BATCH, batch, "linear")
        steps = epochs * N_TRAIN // batch
        warmup = max(1, steps // 20) if k > 1 else 0   # 5% of the steps
        _, held_out, _ = train_minibatch(batch, lr, epochs, warmup)
        rows[k] = (batch, lr, steps, held_out)
    table = "\n".join(f"| {k} | {b:,} | {lr:g} | {s} | {h:.3f} |"
                      for k, (b, lr, s, h) in rows.items())
    one = rows[1][3]
    ratio = {k: r[3] / one for k, r in rows.items()}
    held = max(k for k in rows if all(ratio[j] < HELD for j in rows if j <= k))
    broken = min(k for k in rows if ratio[k] > BROKEN)
    b_simple = _b_simple(lab)
    return {"table": table, "epochs": epochs, "one": one, "ratios": ratio,
            "base_lr": BASE_LR, "held_k": held, "broken_k": broken,
            "held_x": max(ratio[k] for k in rows if k <= held),
            "broken_x": ratio[broken],
            "last_k": max(rows), "last_x": ratio[max(rows)],
            "b_simple": b_simple, "b_held": rows[held][0],
            "b_broken": rows[broken][0],
            "past_held": rows[held][0] / b_simple,
            "past_broken": rows[broken][0] / b_simple}


def training_loss(model, params, x, y):
    return float(model.loss(model.forward(params, x), y, 1 / len(x)))


def to_training_loss(batch, lr, target, warmup, seed=0):
    """Train until the loss on the whole training set reaches
    ``target``; return (steps, training loss, held-out loss)."""
    model = MLP(MODEL)
    (x, y), (x_out, y_out) = split_data(seed)
    params = model.init_params(seed)
    opt = make_optimizer(OptimConfig("momentum", lr=lr, warmup_steps=warmup),
                         model.num_params, params.dtype, model.param_slices)
    grad, step = np.zeros_like(params), 0
    every = max(1, 256 // batch)   # a look every 256 samples
    while step % every or training_loss(model, params, x, y) > target:
        idx = batch_indices(N_TRAIN, batch, step, seed)
        grad[:] = 0
        model.loss_and_grad(params, x[idx], y[idx], 1 / batch, grad)
        opt.step(params, grad)
        step += 1
    return (step, training_loss(model, params, x, y),
            training_loss(model, params, x_out, y_out))


def generalisation_gap(lab):
    target, out = 0.1, {}
    k_large = 32          # the large run's batch: k_large × BASE_BATCH
    for base in (BASE_LR, 2 * BASE_LR):      # tuned, and twice it
        for k in (1, k_large):
            batch = k * BASE_BATCH
            lr = scaled_lr(base, BASE_BATCH, batch, "linear")
            warmup = 0 if k == 1 else 10
            out[base, k] = to_training_loss(batch, lr, target, warmup)
    gap = {key: held - train for key, (_, train, held) in out.items()}
    worse = {base: out[base, k_large][2] / out[base, 1][2]
             for base in (BASE_LR, 2 * BASE_LR)}
    t, u = BASE_LR, 2 * BASE_LR
    return {"target": target, "small": BASE_BATCH,
            "large": k_large * BASE_BATCH, "base_lr": t, "rough_lr": u,
            "steps_small": out[t, 1][0], "steps_large": out[t, k_large][0],
            "train": [v[1] for v in out.values()],
            "held_small": out[t, 1][2], "held_large": out[t, k_large][2],
            "gap_small": gap[t, 1], "gap_large": gap[t, k_large],
            "rough_small": out[u, 1][2], "rough_large": out[u, k_large][2],
            "rough_gap_small": gap[u, 1], "rough_gap_large": gap[u, k_large],
            "worse_pct": 100 * (worse[t] - 1),
            "rough_worse_pct": 100 * (worse[u] - 1),
            "worse": str(k_large * BASE_BATCH if worse[t] > 1
                         else BASE_BATCH)}


def sqrt_rule(k, lr, betas=(0.9, 0.999), eps=1e-8):
    """Malladi et al.'s square-root rule for Adam at k times the batch:
    lr × √k, 1 - β k times larger, ε √k times smaller (None past its
    range: a β below 0)."""
    b1, b2 = (1 - k * (1 - b) for b in betas)
    if min(b1, b2) < 0:
        return None
    return lr * k ** 0.5, (b1, b2), eps / k ** 0.5


def adam_sqrt(lab):
    epochs, base = 8, {}
    for lr in (0.003, 0.01, 0.03):                  # tune Adam at batch 32
        base[lr] = train_minibatch(BASE_BATCH, lr, epochs, optimizer="adam")[1]
    lr0 = min(base, key=base.get)
    rows = {}
    for k in (16, 64):
        batch = k * BASE_BATCH
        warmup = max(1, epochs * N_TRAIN // batch // 20)
        for rule in ("sqrt", "linear"):
            lr = scaled_lr(lr0, BASE_BATCH, batch, rule)
            _, held_out, _ = train_minibatch(batch, lr, epochs, warmup,
                                             optimizer="adam")
            rows[k, rule] = (lr, held_out)
    table = "\n".join(f"| {k} | {r} | {lr:g} | {h:.3f} |"
                      for (k, r), (lr, h) in rows.items())
    full = sqrt_rule(4, lr0)
    return {"table": table, "lr0": lr0, "base": base[lr0], "epochs": epochs,
            "b1_4": full[1][0], "b2_4": full[1][1], "eps_4": full[2],
            "b1_16": 1 - 16 * (1 - 0.9), "full_16": sqrt_rule(16, lr0),
            "grid": ", ".join(f"{lr:g}: {h:.3f}" for lr, h in base.items()),
            "sqrt_wins": all(rows[k, "sqrt"][1] < rows[k, "linear"][1]
                             for k in (16, 64)),
            "lr_sqrt_16": rows[16, "sqrt"][0]}


def train_phases(phases, seed=0):
    """Momentum SGD through ``phases``, each (epochs, batch, lr), one
    optimizer throughout (its momentum carries over). Returns the
    number of updates and the held-out loss at the end."""
    model = MLP(MODEL)
    (x, y), (x_out, y_out) = split_data(seed)
    params = model.init_params(seed)
    opt = make_optimizer(OptimConfig("momentum", lr=phases[0][2]),
                         model.num_params, params.dtype, model.param_slices)
    grad, seen, updates = np.zeros_like(params), 0, 0
    for epochs, batch, lr in phases:
        opt.cfg = replace(opt.cfg, lr=lr)
        for _ in range(epochs * N_TRAIN // batch):
            # the same walk through shuffled epochs, whatever the batch
            idx = batch_indices(N_TRAIN, batch, seen // batch, seed)
            grad[:] = 0
            model.loss_and_grad(params, x[idx], y[idx], 1 / batch, grad)
            opt.step(params, grad)
            seen, updates = seen + batch, updates + 1
    held_out = model.loss(model.forward(params, x_out), y_out, 1 / N_HELD_OUT)
    return updates, float(held_out)


EPOCHS, FACTOR, LR = (4, 1, 1), 4, 0.05   # phases; the batch x4, or the lr / 4
PHASES = ", ".join(str(e) for e in EPOCHS)


def batch_ramp(lab):
    b, f, lr = BASE_BATCH, FACTOR, LR
    decay = [(e, b, lr / f ** i) for i, e in enumerate(EPOCHS)]
    ramp = [(e, b * f ** i, lr) for i, e in enumerate(EPOCHS)]
    big = [(sum(EPOCHS), b * f ** (len(EPOCHS) - 1), lr)]
    runs = {name: train_phases(phases) for name, phases
            in (("decay", decay), ("ramp", ramp), ("big", big))}
    # lr / batch: the noise of a step, phase by phase (Smith et al.)
    noise = {name: [lr / batch for _, batch, lr in phases]
             for name, phases in (("decay", decay), ("ramp", ramp))}
    return {"epochs": sum(EPOCHS), "phases": PHASES, "f": f,
            "lr": lr, "b": b,
            "batches": ", ".join(f"{bb:,}" for _, bb, _ in ramp),
            "lrs": ", ".join(f"{x:g}" for _, _, x in decay),
            "decay_updates": runs["decay"][0], "decay": runs["decay"][1],
            "updates": runs["ramp"][0], "ramp": runs["ramp"][1],
            "big_updates": runs["big"][0], "big": runs["big"][1],
            "big_batch": big[0][1],
            "saved": 1 - runs["ramp"][0] / runs["decay"][0],
            "within": runs["ramp"][1] / runs["decay"][1] - 1,
            "same_noise": all(abs(a - c) <= 1e-15 * a for a, c
                              in zip(noise["decay"], noise["ramp"])),
            "b_simple": _b_simple(lab),
            "b_start": noise_scale(_noise(lab)[0][0])[0]}


STEPS = (
    Step(
        title="Gradient noise: per-sample gradients and the noise scale",
        text=("A minibatch gradient is an estimate of the mean gradient G over the data. Take the "
              "gradient of each of {probe:,} training samples on their own (**per-sample gradients**): "
              "their mean is G, and their spread around it is the covariance Σ, whose trace tr(Σ) is the "
              "total variance. A minibatch of B samples misses G by tr(Σ)/B on average (squared length): "
              "drawn 400 times at B = {batch}, it missed by {miss:.3g}, against tr(Σ)/B = {predicted:.3g}."
              "\n\n**The simple noise scale** B_simple = tr(Σ) / |G|² (McCandlish et al. 2018) is the "
              "batch at which that miss is as large as G itself. Below it a larger batch removes noise that "
              "matters; far above it the gradient is already nearly exact. (Their **B_noise** = "
              "tr(HΣ) / GᵀHG weighs each direction by the curvature H, which decides what a noisy step "
              "costs in loss; the two are equal when H is a multiple of the identity. B_simple needs only "
              "gradients, so it is what McCandlish et al. measure in practice, and what is measured here.) "
              "For this model at the start (loss {loss_start:.2f}) B_simple = **{b_start:.0f}**; after "
              "200 steps (loss {loss:.2f}) it is "
              "**{b_simple:.0f}**: as the loss falls, the mean gradient shrinks faster than the noise, so "
              "the batch worth using grows during training."),
        run=gradient_noise,
        checks=(Check("a minibatch misses the mean gradient by tr(Σ)/B, within 15%",
                      lambda f: abs(f["rel"] - 1) < 0.15),
                Check("B_simple grows as training proceeds", lambda f: f["b_simple"] > 2 * f["b_start"])),
        predict=Predict("The simple noise scale B_simple = tr(Σ)/|G|² is the batch size at which a minibatch "
                        "gradient's noise (the spread of single samples' gradients, tr(Σ), over B) is as "
                        "large as the mean gradient G itself. As training lowers the loss, does B_simple get "
                        "'larger' or 'smaller'?", "grows",
                        choices=("larger", "smaller"),
                        misconceptions=(("smaller", "near a minimum the mean gradient G shrinks toward "
                                                    "0, but single samples still disagree: tr(Σ)/|G|² "
                                                    "grows"),)),
        hint="B_simple = tr(Σ)/|G|²: what happens to each part near a minimum?",
        hints=("Near a minimum the mean gradient G goes to zero, but single samples still disagree.",),
        show=(per_sample_grads, noise_scale),
        try_this="Print noise_scale at steps 0, 50, 200 and 800 of trained(): when does it level off?",
        teaches=("batch-size",),
    ),
    Step(
        title="The critical batch: steps stop falling, samples keep rising",
        text=("Train to a held-out loss of {target} with each batch at its own best lr (momentum SGD, "
              "lrs 0.0125 × 2^i):\n\n| batch | best lr | steps | samples |\n|---|---|---|---|\n{table}\n\n"
              "Going from batch 8 to 32 cut the steps {first_gain:.1f}x; from {b_before:,} to {b_last:,} "
              "only {last_gain:.1f}x, while the samples (the compute) kept growing. McCandlish et al. "
              "model this as S = S_min (1 + B_crit/B): fitted here, S_min = {s_min:.0f} steps and the "
              "**critical batch** B_crit = {b_crit:.0f}, of the same order as the B_simple of "
              "{b_simple:.0f} measured in step 1 ({ratio:.2g}x it: they predict B_crit ≈ B_noise, which "
              "B_simple estimates, and both move as the loss falls). Below B_crit, more ranks "
              "(a larger global batch) buy fewer steps almost for free; "
              "above it they buy almost nothing and cost compute."),
        run=critical_batch,
        checks=(Check("steps never rise with the batch",
                      lambda f: f["steps"] == sorted(f["steps"], reverse=True)),
                Check("samples to the target rise with the batch beyond 32",
                      lambda f: f["samples"][1:] == sorted(f["samples"][1:])),
                Check("small batches gain far more from doubling than large ones",
                      lambda f: f["first_gain"] > 2 * f["last_gain"]),
                Check("the fitted B_crit is within 4x of the measured B_simple",
                      lambda f: 0.25 < f["ratio"] < 4)),
        inputs={"b_before": BATCHES[-2], "b_last": BATCHES[-1]},
        predict=Predict("From batch {b_before:,} to {b_last:,}, are the steps to the target '4x fewer' or "
                        "'about the same'?", "fewer", choices=("4x fewer", "about the same"),
                        misconceptions=(("4x fewer", "that is perfect scaling, which holds only far "
                                                     "below the critical batch"),)),
        hint="Far above B_simple the gradient is almost exact: a larger batch cannot make a step better.",
        picture=lambda f: _bars([(f"B={b:,}", s) for b, s in zip(f["batches"], f["steps"])], " steps",
                                title=f"steps to held-out loss {f['target']}"),
        try_this="Set TARGET to 0.12 in l13_batch_size.py: B_simple is larger later on; does B_crit follow?",
        teaches=("batch-size",),
    ),
    Step(
        title="Where the linear lr rule breaks",
        text=("Goyal et al. (2017) trained ImageNet with the linear rule and a warm-up up to a global batch "
              "of 8k, and saw it break beyond. The same here, {epochs} epochs each, lr {base_lr:g} × k "
              "(lesson 6 tuned {base_lr:g} at batch 32), warm-up over 5% of the steps:\n\n"
              "| k | batch | lr | steps | held-out loss |\n|---|---|---|---|---|\n{table}\n\n"
              "Up to k = {held_k} the held-out loss stays within {held_x:.2f}x of batch 32's; at "
              "k = {broken_k} it is {broken_x:.1f}x. The rule assumes k small steps ≈ one big step: that the "
              "k gradients a big batch averages would have moved the parameters about as far one after "
              "another. That holds while the steps are small, and the noise scale is only a rough guide "
              "to where it ends: here the rule still held at batch {b_held:,}, {past_held:.1f}x the "
              "B_simple of {b_simple:.0f} measured in step 1, and had broken by batch {b_broken:,} "
              "({past_broken:.0f}x it), where a bigger batch removes little more noise and the k-times "
              "larger lr overshoots."),
        run=linear_rule_breaks,
        checks=(Check("up to k = {held_k}, and at least to 16, the linear rule keeps the held-out loss "
                      "within 1.3x",
                      lambda f: f["held_k"] >= 16 and f["held_x"] < HELD),
                Check("at k = {last_k} it is over 2x worse",
                      lambda f: f["last_x"] > BROKEN and f["broken_k"] <= f["last_k"])),
        hint="The linear rule keeps lr/B fixed: the same update per sample seen, if the steps were small.",
        try_this="dplab compare --global-batches 32,512,4096 --lr-rule linear --warmup-steps 5",
        teaches=("batch-size", "lr-scaling"),
    ),
    Step(
        title="The generalisation gap, on held-out data",
        text=("Train batch {small} and batch {large:,} (linear rule from lesson 6's tuned lr "
              "{base_lr:g}, warm-up) until the loss on the training set reaches {target}: "
              "{steps_small} and {steps_large} steps. Their held-out losses: **{held_small:.3f}** and "
              "**{held_large:.3f}**, {worse_pct:.0f}% higher for the large batch at the same fit to "
              "the training data; the gap between held-out and training loss is {gap_small:.3f} against "
              "{gap_large:.3f}. A training loss alone would have called the two runs equal.\n\n"
              "Why large batches generalise worse, and whether they must, is contested. Keskar et al. "
              "(2017) saw this gap on real networks and blamed sharp minima, which a small batch's "
              "noise escapes. Dinh et al. (2017) showed that sharpness is not a property of the function a "
              "network computes: rescaling a ReLU network's layers can make a minimum arbitrarily sharp "
              "without changing one prediction. Hoffer et al. (2017) closed the gap by training longer "
              "(the large batch here took {steps_large} updates against {steps_small}), and Shallue et al. "
              "(2019), tuning each batch size's own metaparameters, found no evidence that larger batches "
              "degrade the best held-out quality. The lr alone moves it here: from twice the tuned base "
              "({rough_lr:g}), the large "
              "batch is {rough_worse_pct:.0f}% worse ({rough_large:.3f} against {rough_small:.3f}), "
              "its gap {rough_gap_large:.3f}. Measure held-out loss with tuned lrs before blaming the "
              "batch."),
        run=generalisation_gap,
        checks=(Check("all four runs reach the training loss", lambda f: max(f["train"]) <= f["target"]),
                Check("tuned, the large batch's held-out loss is higher at the same training loss",
                      lambda f: f["worse_pct"] > 0 and f["gap_large"] > f["gap_small"]),
                Check("from twice the tuned lr, the large batch falls further behind",
                      lambda f: f["rough_worse_pct"] > 1.5 * f["worse_pct"])),
        inputs={"small": BASE_BATCH, "large": 32 * BASE_BATCH},
        predict=Predict("At the same training loss, which has the higher held-out loss: batch {small} or "
                        "{large}?", "worse", choices=("32", "1024"),
                        misconceptions=(("32", "the small batch's noisier steps fit the training set no "
                                               "better than the large batch's: at the same training loss "
                                               "it is the large batch that does worse here"),)),
        hint="Keskar et al.'s answer: a small batch's noise keeps it out of sharp minima (contested: read "
             "the step).",
        try_this=("In generalisation_gap, set k_large = 8 (batch 8 × 32 = 256, not 1,024): is its gap "
                  "between the two?"),
        teaches=("batch-size",),
    ),
    Step(
        title="Adam wants its lr scaled by the square root of the batch",
        text=("SGD's step is lr × gradient; Adam divides by the gradient's running size, so its step is "
              "about lr whatever the batch, and a k-times larger batch only makes it √k times less noisy. "
              "Malladi et al. (2022) derive the **square-root rule** for Adam: lr × √k. Tuned at batch 32 "
              "({grid}: lr {lr0:g} is best, held-out {base:.3f}), then scaled, {epochs} epochs each:\n\n"
              "| k | rule | lr | held-out loss |\n|---|---|---|---|\n{table}\n\n"
              "The square-root rule beats the linear one at both k: for Adam the linear rule's lr is "
              "√k times too large.\n\n"
              "Malladi et al.'s rule is more than the lr: keeping the same SDE (the stochastic "
              "differential equation that approximates Adam's path) also makes 1 - β₁ and 1 - β₂ k times "
              "larger and ε √k times smaller. At k = 4 from the defaults (β₁ = 0.9, β₂ = 0.999, "
              "ε = 1e-8): β₁ = {b1_4:.2g}, "
              "β₂ = {b2_4:.4g}, ε = {eps_4:.1e}. It is derived for k(1 - β₁) small, and past k = 10 it "
              "has no β₁ at all (at k = 16, 1 - 16 × 0.1 = {b1_16:.1f}). This step scales only the lr."),
        run=adam_sqrt,
        checks=(Check("Adam's sqrt rule beats its linear rule at k = 16 and 64", lambda f: f["sqrt_wins"]),
                Check("the full rule's β₁ at k = 4 is 1 - 4 × 0.1, and at k = 16 there is none",
                      lambda f: abs(f["b1_4"] - 0.6) < 1e-12 and f["full_16"] is None)),
        show=(sqrt_rule, adam_sqrt),
        predict=Predict("Adam trains batch 32 at lr {lr0:g}. By the sqrt rule, what lr goes with batch 512?",
                        "lr_sqrt_16", rel_tol=1e-9,
                        misconceptions=((lambda g, f: abs(g - 16 * f["lr0"]) < 1e-9,
                                         "that is the linear rule (× 16); the sqrt rule is × √16 = × 4"),)),
        hint="k = 512 / 32 = 16; √16 = 4.",
        try_this="Try LAMB (optimizer='lamb') at k = 64 with the sqrt rule (lesson 6's trust ratio).",
        teaches=("batch-size", "lr-scaling"),
    ),
    Step(
        title="Ramp the batch up instead of decaying the lr",
        text=("Step 1 found the noise scale growing as the loss falls: the batch worth using grows "
              "during training. Smith et al. (2018), \"Don't decay the learning rate, increase the "
              "batch size\": a step's noise goes as lr/B, so dividing the lr by {f} and "
              "multiplying the batch by {f} lower it alike, and the larger batch takes {f} times "
              "fewer updates, each of which data parallelism spreads over more ranks. GPT-3 ramps "
              "its batch the same way, from 32k tokens up to its full 3.2M over the first 4 to 12 "
              "billion tokens (Brown et al. 2020).\n\n{epochs} epochs of momentum SGD from lr "
              "{lr:g} at batch {b}, in phases of {phases} epochs. **Decay**: the batch stays {b}, "
              "the lr goes {lrs}: {decay_updates:,} updates, held-out loss **{decay:.4f}**. "
              "**Ramp**: the lr stays {lr:g}, the batch goes {batches} (lr/B is the same as "
              "decay's in every phase: {same_noise}): **{updates:,}** updates, held-out "
              "**{ramp:.4f}**, {within:+.1%} from decay with {saved:.0%} fewer updates. Starting "
              "at the final batch instead ({big_batch} from the first step, {big_updates} updates) "
              "ends at {big:.3f}: early on the noise scale is small (B_simple {b_start:.0f} at the "
              "start, {b_simple:.0f} after 200 steps), and a batch far above it wastes its "
              "samples; later the same batch costs little."),
        run=batch_ramp,
        checks=(Check("the ramp keeps decay's lr/B in every phase", lambda f: f["same_noise"]),
                Check("the ramp ends within 10% of decay's held-out loss",
                      lambda f: abs(f["within"]) < 0.1),
                Check("with at least 25% fewer updates", lambda f: f["saved"] >= 0.25),
                Check("the final batch from the start ends over 2x worse",
                      lambda f: f["big"] > 2 * max(f["ramp"], f["decay"])),
                Check("that batch is over 10x B_simple at the start",
                      lambda f: f["big_batch"] > 10 * f["b_start"])),
        inputs={"phases": PHASES, "b": BASE_BATCH, "f": FACTOR, "n_train": N_TRAIN,
                "batches": ", ".join(f"{BASE_BATCH * FACTOR ** i:,}" for i in range(len(EPOCHS)))},
        predict=Predict("{n_train:,} training samples; phases of {phases} epochs at batches "
                        "{batches}. How "
                        "many updates does the ramp take?", "updates",
                        misconceptions=((lambda g, f: g == f["decay_updates"], "that is batch {b} "
                                                                               "all the way "
                                         "(decay's count): the larger batches take fewer updates "
                                         "per epoch"),
                                        (lambda g, f: g == f["big_updates"], "that is the final "
                                                                             "batch all "
                                         "the way: the first phase still runs at batch {b}"))),
        hint="Updates per epoch = samples / batch, phase by phase.",
        hints=(" + ".join(f"{e} × {N_TRAIN:,}/{BASE_BATCH * FACTOR ** i:,}"
                          for i, e in enumerate(EPOCHS)),),
        show=(train_phases,),
        try_this="Set FACTOR = 8 in l13_batch_size.py: does the ramp still keep up with decay?",
        teaches=("batch-size", "batch-ramp"),
    ),
)

LESSON = Lesson(13, "batch_size", "Batch-size economics: noise scale, critical batch, generalisation",
                "What a larger global batch buys, where it stops paying (the noise scale, B_crit), and how "
                "the lr must follow it for SGD and Adam.", STEPS)
