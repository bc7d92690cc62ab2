"""Lesson 13: batch-size economics - what a larger global batch buys, and where it stops paying.

    dplab lesson 13

Data parallelism grows the global batch with the ranks (weak scaling, lesson 5). Five steps on
the spine's model and optimizers, one device standing in for p ranks (lesson 1: the same SGD):
the gradient noise scale from per-sample gradients (McCandlish et al. 2018); the critical batch,
where steps stop falling and samples start rising; where the linear lr rule breaks (Goyal et al.
2017); the generalisation gap on held-out data; and why Adam scales its lr with the square root
of the batch.
"""

from __future__ import annotations

import numpy as np

from dplab.lessons.l05_scaling import _bars
from dplab.lessons.l06_large_batches import BASE_BATCH, BASE_LR, MODEL, N_TRAIN, split_data, train_minibatch
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
    """McCandlish et al.'s simple noise scale B_noise = tr(Σ) / |G|^2:
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
    """B_noise at the start and after 200 steps (kept: step 2 compares)."""
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
    b_noise, trace, mean = noise_scale(grads)
    # a minibatch's gradient misses the mean by tr(Σ)/B on average
    rng, batch = np.random.default_rng(0), 16
    draws = [grads[rng.integers(0, PROBE, batch)].mean(axis=0)
             for _ in range(400)]
    miss = np.mean([((g - mean) ** 2).sum() for g in draws])
    start = noise_scale(points[0][0])[0]
    return {"probe": PROBE, "b_start": start, "b_noise": b_noise,
            "loss_start": points[0][1], "loss": loss, "trace": trace,
            "batch": batch, "miss": miss, "predicted": trace / batch,
            "rel": miss / (trace / batch),
            "grows": "larger" if b_noise > start else "smaller"}


def _b_noise(lab):
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
    b_noise = _b_noise(lab)
    last, before = rows[BATCHES[-1]][0], rows[BATCHES[-2]][0]
    return {"table": table, "target": TARGET, "steps": steps.tolist(),
            "samples": [rows[b][0] * b for b in BATCHES],
            "batches": list(BATCHES),
            "s_min": s_min, "b_crit": b_crit, "b_noise": b_noise,
            "ratio": b_crit / b_noise, "last_gain": before / max(last, 1),
            "first_gain": rows[BATCHES[0]][0] / rows[BATCHES[1]][0],
            "b_last": BATCHES[-1], "b_before": BATCHES[-2],
            "fewer": "about the same" if before < 2 * last else "4x fewer"}


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
    b_noise = _b_noise(lab)
    return {"table": table, "epochs": epochs, "one": one,
            "x16": rows[16][3] / one, "x64": rows[64][3] / one,
            "x128": rows[128][3] / one, "b_noise": b_noise,
            "b16": rows[16][0], "b64": rows[64][0],
            "past16": rows[16][0] / b_noise,
            "past64": rows[64][0] / b_noise}


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
    while step % 8 or training_loss(model, params, x, y) > target:
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
    for k in (1, k_large):
        batch = k * BASE_BATCH
        lr = scaled_lr(BASE_LR, BASE_BATCH, batch, "linear")
        warmup = 0 if k == 1 else 10
        out[k] = to_training_loss(batch, lr, target, warmup)
    gap = {k: held - train for k, (_, train, held) in out.items()}
    return {"target": target, "small": BASE_BATCH,
            "large": k_large * BASE_BATCH,
            "steps_small": out[1][0], "steps_large": out[k_large][0],
            "train_small": out[1][1], "train_large": out[k_large][1],
            "held_small": out[1][2], "held_large": out[k_large][2],
            "gap_small": gap[1], "gap_large": gap[k_large],
            "gap_x": gap[k_large] / gap[1],
            "worse": str(k_large * BASE_BATCH if out[k_large][2] > out[1][2]
                         else BASE_BATCH)}


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
    return {"table": table, "lr0": lr0, "base": base[lr0], "epochs": epochs,
            "grid": ", ".join(f"{lr:g}: {h:.3f}" for lr, h in base.items()),
            "sqrt_wins": all(rows[k, "sqrt"][1] < rows[k, "linear"][1]
                             for k in (16, 64)),
            "lr_sqrt_16": rows[16, "sqrt"][0]}


STEPS = (
    Step(
        title="Gradient noise: per-sample gradients and B_noise",
        text=("A minibatch gradient is an estimate of the mean gradient G over the data. Take the "
              "gradient of each of {probe:,} training samples on their own (**per-sample gradients**): "
              "their mean is G, and their spread around it is the covariance Σ, whose trace tr(Σ) is the "
              "total variance. A minibatch of B samples misses G by tr(Σ)/B on average (squared length): "
              "drawn 400 times at B = {batch}, it missed by {miss:.3g}, against tr(Σ)/B = {predicted:.3g}."
              "\n\n**The noise scale** B_noise = tr(Σ) / |G|² (McCandlish et al. 2018) is the batch at "
              "which that miss is as large as G itself. Below it a larger batch removes noise that matters; "
              "far above it the gradient is already nearly exact. For this model at the start (loss "
              "{loss_start:.2f}) B_noise = **{b_start:.0f}**; after 200 steps (loss {loss:.2f}) it is "
              "**{b_noise:.0f}**: as the loss falls, the mean gradient shrinks faster than the noise, so "
              "the batch worth using grows during training."),
        run=gradient_noise,
        checks=(Check("a minibatch misses the mean gradient by tr(Σ)/B, within 15%",
                      lambda f: abs(f["rel"] - 1) < 0.15),
                Check("B_noise grows as training proceeds", lambda f: f["b_noise"] > 2 * f["b_start"])),
        predict=Predict("The noise scale B_noise = tr(Σ)/|G|² is the batch size at which a minibatch "
                        "gradient's noise (the spread of single samples' gradients, tr(Σ), over B) is as "
                        "large as the mean gradient G itself. As training lowers the loss, does B_noise get "
                        "'larger' or 'smaller'?", "grows",
                        choices=("larger", "smaller"),
                        misconceptions=(("smaller", "near a minimum the mean gradient G shrinks toward "
                                                    "0, but single samples still disagree: tr(Σ)/|G|² "
                                                    "grows"),)),
        hint="B_noise = tr(Σ)/|G|²: what happens to each part near a minimum?",
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
              "**critical batch** B_crit = {b_crit:.0f}, near the B_noise of {b_noise:.0f} measured in "
              "step 1. Below B_crit, more ranks (a larger global batch) buy fewer steps almost for free; "
              "above it they buy almost nothing and cost compute."),
        run=critical_batch,
        checks=(Check("steps never rise with the batch",
                      lambda f: f["steps"] == sorted(f["steps"], reverse=True)),
                Check("samples to the target rise with the batch beyond 32",
                      lambda f: f["samples"][1:] == sorted(f["samples"][1:])),
                Check("small batches gain far more from doubling than large ones",
                      lambda f: f["first_gain"] > 2 * f["last_gain"]),
                Check("the fitted B_crit is within 4x of the measured B_noise",
                      lambda f: 0.25 < f["ratio"] < 4)),
        inputs={"b_before": BATCHES[-2], "b_last": BATCHES[-1]},
        predict=Predict("From batch {b_before:,} to {b_last:,}, are the steps to the target '4x fewer' or "
                        "'about the same'?", "fewer", choices=("4x fewer", "about the same"),
                        misconceptions=(("4x fewer", "that is perfect scaling, which holds only far "
                                                     "below the critical batch"),)),
        hint="Far above B_noise the gradient is almost exact: a larger batch cannot make a step better.",
        picture=lambda f: _bars([(f"B={b:,}", s) for b, s in zip(f["batches"], f["steps"])], " steps",
                                title=f"steps to held-out loss {f['target']}"),
        try_this="Set TARGET to 0.12 in l13_batch_size.py: B_noise is larger later on; does B_crit follow?",
        teaches=("batch-size",),
    ),
    Step(
        title="Where the linear lr rule breaks",
        text=("Goyal et al. (2017) trained ImageNet with the linear rule and a warm-up up to a global batch "
              "of 8k, and saw it break beyond. The same here, {epochs} epochs each, lr 0.05 × k, warm-up "
              "over 5% of the steps:\n\n| k | batch | lr | steps | held-out loss |\n|---|---|---|---|---|\n"
              "{table}\n\n"
              "Up to k = 16 the held-out loss stays within {x16:.2f}x of batch 32's; at k = 64 it is "
              "{x64:.1f}x, at k = 128 {x128:.1f}x. The rule assumes k small steps ≈ one big step: that the "
              "k gradients a big batch averages would have moved the parameters about as far one after "
              "another. That holds while the steps are small, and the noise scale is only a rough guide "
              "to where it ends: here the rule still held at batch {b16:,}, {past16:.1f}x the B_noise of "
              "{b_noise:.0f} measured in step 1, and had broken by batch {b64:,} ({past64:.0f}x it), "
              "where a bigger batch removes little more noise and the k-times larger lr overshoots."),
        run=linear_rule_breaks,
        checks=(Check("up to k = 16 the linear rule keeps the held-out loss within 1.3x",
                      lambda f: f["x16"] < 1.3),
                Check("at k = 128 it is over 3x worse", lambda f: f["x128"] > 3)),
        hint="The linear rule keeps lr/B fixed: the same update per sample seen, if the steps were small.",
        try_this="dplab compare --global-batches 32,512,4096 --lr-rule linear --warmup-steps 5",
        teaches=("batch-size", "lr-scaling"),
    ),
    Step(
        title="The generalisation gap, on held-out data",
        text=("Train batch {small} and batch {large:,} (linear rule, warm-up) until the loss on the "
              "training set reaches {target}: {steps_small} and {steps_large} steps, ending at training "
              "losses of {train_small:.3f} and {train_large:.3f}. Their held-out losses: "
              "**{held_small:.3f}** and **{held_large:.3f}**. The gap between held-out and "
              "training loss is {gap_small:.3f} for the small batch and {gap_large:.3f} for the large one, "
              "{gap_x:.1f}x: at the same fit to the training data, the large batch does worse on data it "
              "has not seen (Keskar et al. 2017 saw the same on real networks). A training loss alone "
              "would have called the two runs equal."),
        run=generalisation_gap,
        checks=(Check("both runs reach the training loss", lambda f: max(f["train_small"], f["train_large"])
                      <= f["target"]),
                Check("the large batch's held-out gap is over twice the small one's",
                      lambda f: f["gap_x"] > 2)),
        inputs={"small": BASE_BATCH, "large": 32 * BASE_BATCH},
        predict=Predict("At the same training loss, which has the higher held-out loss: batch {small} or "
                        "{large}?", "worse", choices=("32", "1024"),
                        misconceptions=(("32", "the small batch's noisier steps are what keeps it out of "
                                               "minima that fit only the training set"),)),
        hint="Small batches' noise keeps them out of sharp minima that fit the training set only.",
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
              "√k times too large."),
        run=adam_sqrt,
        checks=(Check("Adam's sqrt rule beats its linear rule at k = 16 and 64", lambda f: f["sqrt_wins"]),),
        predict=Predict("Adam trains batch 32 at lr {lr0:g}. By the sqrt rule, what lr goes with batch 512?",
                        "lr_sqrt_16", rel_tol=1e-9,
                        misconceptions=((lambda g, f: abs(g - 16 * f["lr0"]) < 1e-9,
                                         "that is the linear rule (× 16); the sqrt rule is × √16 = × 4"),)),
        hint="k = 512 / 32 = 16; √16 = 4.",
        try_this="Try LAMB (optimizer='lamb') at k = 64 with the sqrt rule (lesson 6's trust ratio).",
        teaches=("batch-size", "lr-scaling"),
    ),
)

LESSON = Lesson(13, "batch_size", "Batch-size economics: noise scale, critical batch, generalisation",
                "What a larger global batch buys, where it stops paying (B_noise, B_crit), and how the lr "
                "must follow it for SGD and Adam.", STEPS)
