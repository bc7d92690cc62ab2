"""Lesson 6: learning-rate scaling, warm-up, LARS and LAMB - what a large global batch needs.

    dplab lesson 6

Data parallelism grows the global batch with the ranks (lesson 1: N ranks are one device with
an N times larger batch). Three steps: the same samples in fewer, larger steps need a larger lr
(linear and sqrt rules); a large lr needs a warm-up; LARS and LAMB give every layer its own lr.
"""

from __future__ import annotations

import numpy as np

from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.data import batch_indices
from dplab.reference.lr import scaled_lr
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.train.single import TrainConfig, evaluate, setup, train_single

__all__ = ["LESSON"]

MODEL = MLPConfig(loss="xent")                 # 8 -> 16 -> 16 -> 4 classes


def classify(global_batch, steps, lr, warmup_steps=0, optimizer="momentum"):
    opt = OptimConfig(optimizer, lr=lr, warmup_steps=warmup_steps)
    return TrainConfig(model=MODEL, dataset="classification",
                       num_samples=512, global_batch=global_batch,
                       steps=steps, optimizer=opt)


def same_samples_fewer_steps(lab):
    # one device, 480 steps of 32: 15,360 samples
    small = classify(global_batch=32, steps=480, lr=0.05)
    small_loss = evaluate(small, train_single(small).params)
    big = {}
    # 4 ranks x 128 = 512 a step, 30 steps: the same samples
    for rule in ("none", "sqrt", "linear"):
        lr = scaled_lr(0.05, base_batch=32, global_batch=512, rule=rule)
        spec = RunSpec(world_size=4, train=classify(512, 30, lr))
        row, _ = run_train(spec, world=lab.world(4))
        big[rule] = (lr, row["final_loss"])
    return {"small_loss": small_loss,
            "none": big["none"][1],
            "sqrt": big["sqrt"][1],
            "linear": big["linear"][1],
            "lr_linear": big["linear"][0],
            "lr_sqrt": big["sqrt"][0],
            "samples": small.steps * small.global_batch,
            "small_steps": small.steps, "big_steps": 30,
            "k": 512 // small.global_batch,
            "base_lr": small.optimizer.lr,
            "base_batch": small.global_batch}


def warm_up(lab):
    curves = {}
    lr, warmup_steps = 6.4, 10
    for warmup in (0, warmup_steps):
        cfg = classify(global_batch=512, steps=30, lr=lr,
                       warmup_steps=warmup)
        result = train_single(cfg)
        curves[warmup] = (result.losses, evaluate(cfg, result.params))
    cold, cold_end = curves[0]
    warm, warm_end = curves[warmup_steps]
    return {"start": cold[0],
            "cold_peak": max(cold[:10]),
            "warm_peak": max(warm[:10]),
            "cold_end": cold_end,
            "warm_end": warm_end,
            "lr": lr, "warmup_steps": warmup_steps}


def one_lr_per_layer(lab):
    cfg = classify(global_batch=512, steps=1, lr=1.0)
    B = cfg.global_batch
    model, data, params = setup(cfg)
    idx = batch_indices(cfg.num_samples, B, step=0, seed=cfg.seed)
    x, y = data.x[idx], data.y[idx]
    grad = np.zeros_like(params)
    model.loss_and_grad(params, x, y, 1 / B, grad)
    # the weight matrices (biases start at 0)
    weights = model.param_slices[0::2]
    norm = np.linalg.norm
    moved = {}
    for name in ("sgd", "lars"):
        new = params.copy()
        cfg_opt = OptimConfig(name, lr=1.0, trust_coef=0.01)
        opt = make_optimizer(cfg_opt, model.num_params,
                             layers=model.param_slices)
        opt.step(new, grad)
        moved[name] = [norm(new[w] - params[w]) / norm(params[w])
                       for w in weights]
    ratios = [norm(params[w]) / norm(grad[w]) for w in weights]
    return {"ratios": [round(float(r), 2) for r in ratios],
            "sgd": [round(float(m), 4) for m in moved["sgd"]],
            "lars": [float(m) for m in moved["lars"]],
            "eta": 0.01}


STEPS = (
    Step(
        title="The same samples in fewer steps need a larger lr",
        text=("One device with batch {base_batch} and lr {base_lr:g} sees {samples:,} samples in "
              "{small_steps} steps and ends at loss **{small_loss:.4f}**. Four ranks with a global "
              "batch of 512 see them in {big_steps} steps. With the lr unchanged they end at "
              "**{none:.4f}**: each step averages more samples, so its gradient is less noisy, but "
              "there are {k}x fewer steps. The **sqrt rule** (lr × √{k} = {lr_sqrt:g}) reaches "
              "{sqrt:.4f}; the **linear rule** (lr × {k} = {lr_linear:g}) reaches {linear:.4f}."),
        run=same_samples_fewer_steps,
        checks=(Check("with the lr unchanged, the big batch ends behind the small one",
                      lambda f: f["none"] > f["small_loss"]),
                Check("the sqrt rule beats no rule, and the linear rule beats sqrt here",
                      lambda f: f["linear"] < f["sqrt"] < f["none"])),
        predict=Predict("Batch 32 trains with lr 0.05. By the linear rule, what lr goes with a global "
                        "batch of 512?", "lr_linear", rel_tol=1e-9),
        hint="Linear: k times the batch, k times the lr (Goyal et al. 2017). Here k = 512 / 32.",
        try_this="dplab compare --global-batches 64,256,1024 --lr-rule linear,sqrt,none --optimizer momentum",
        teaches=("lr-scaling", "large-batch-sgd"),
    ),
    Step(
        title="A large lr needs a warm-up",
        text=("Scale further (lr {lr:g}) and the first steps overshoot: without warm-up the loss climbs from "
              "{start:.2f} to **{cold_peak:.2f}** within ten steps and ends at {cold_end:.3f}. A linear "
              "warm-up over the first {warmup_steps} updates (lr/{warmup_steps}, 2·lr/{warmup_steps}, ...) "
              "keeps the peak at "
              "**{warm_peak:.2f}** and ends at {warm_end:.3f}: early on the gradient changes fast, and "
              "the linear rule's assumption (k small steps ≈ one big step) does not hold yet."),
        run=warm_up,
        checks=(Check("without warm-up the loss more than doubles its start in the first ten steps",
                      lambda f: f["cold_peak"] > 2 * f["start"]),
                Check("with warm-up the early peak is less than half of that",
                      lambda f: f["warm_peak"] < f["cold_peak"] / 2),
                Check("and the run ends lower", lambda f: f["warm_end"] < f["cold_end"])),
        hint="reference/lr.py: warmup_lr ramps from lr/warmup_steps at update 1 to the full lr.",
        try_this="dplab train --dataset classification --global-batch 512 --lr 6.4 --warmup-steps 10",
        teaches=("lr-scaling",),
    ),
    Step(
        title="LARS: every layer moves the same fraction of itself",
        text=("One lr for the whole model moves each layer by lr·‖g‖/‖w‖ of its own size. The ratios "
              "‖w‖/‖g‖ of the weight matrices are {ratios}, so one SGD step at lr 1 moves them by "
              "{sgd} of their norms: whatever lr suits one layer is off for another, and in deep "
              "networks these ratios differ by orders of magnitude (You et al. 2017). **LARS** scales "
              "each layer's step by its trust ratio η‖w‖/‖g‖, so every layer moves by exactly lr·η = "
              "{eta} of its norm. LAMB does the same to Adam's update."),
        run=one_lr_per_layer,
        checks=(Check("SGD moves the layers by different fractions of their norms",
                      lambda f: max(f["sgd"]) > 1.2 * min(f["sgd"])),
                Check("LARS moves every weight matrix by lr·η of its norm (to 1e-12)",
                      lambda f: all(abs(m - f["eta"]) < 1e-12 for m in f["lars"]))),
        hint="reference/optim_layerwise.py: trust_ratio, and why a zero norm (a bias at start) gets ratio 1.",
        try_this="dplab train --dataset classification --optimizer lars --lr 5 --global-batch 512",
        teaches=("lr-scaling",),
    ),
)

LESSON = Lesson(6, "large_batches", "Learning-rate scaling, warm-up, LARS and LAMB",
                "How the lr must change when data parallelism makes the global batch large.", STEPS)
