"""Lesson 6: learning-rate scaling, warm-up, LARS and LAMB - what a large global batch needs.

    dplab lesson 6

Data parallelism grows the global batch with the ranks (lesson 1: N ranks are one device with
an N times larger batch). Four steps: the same samples in fewer, larger steps need a larger lr
(linear and sqrt rules); a large lr needs a warm-up; LARS and LAMB give every layer its own lr;
LAMB run against LARS and momentum SGD at a large batch.
"""

from __future__ import annotations

import numpy as np

from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.data import batch_indices, make_dataset
from dplab.reference.lr import scaled_lr
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig, local_norms, make_optimizer, trust_ratio
from dplab.reference.train.single import TrainConfig, setup

__all__ = ["LESSON", "split_data", "train_minibatch", "N_TRAIN", "N_HELD_OUT", "BASE_BATCH", "BASE_LR"]

MODEL = MLPConfig(loss="xent")                 # 8 -> 16 -> 16 -> 4 classes


N_TRAIN, N_HELD_OUT = 4096, 2048   # the held-out samples are never trained on
BASE_BATCH, BASE_LR = 32, 0.025      # a small batch, and the lr step 1 tunes for it


def split_data(seed=0):
    """One labelled data set (one teacher), cut into training and
    held-out samples."""
    data = make_dataset("classification", N_TRAIN + N_HELD_OUT, MODEL.in_dim, MODEL.out_dim, seed)
    return (data.x[:N_TRAIN], data.y[:N_TRAIN]), (data.x[N_TRAIN:], data.y[N_TRAIN:])


def train_minibatch(batch, lr, epochs, warmup_steps=0, optimizer="momentum",
                    seed=0):
    """Minibatch SGD on the training samples, one device (lesson 1: the
    same bits as p ranks with a global batch of ``batch``). Returns the
    loss of every step's batch, the held-out loss at the end, and the
    final parameters."""
    model = MLP(MODEL)
    (x, y), (x_out, y_out) = split_data(seed)
    params = model.init_params(seed)
    cfg = OptimConfig(optimizer, lr=lr, warmup_steps=warmup_steps)
    opt = make_optimizer(cfg, model.num_params, params.dtype,
                         model.param_slices)
    grad, losses = np.zeros_like(params), []
    for step in range(epochs * N_TRAIN // batch):
        # a fresh shuffle every epoch
        idx = batch_indices(N_TRAIN, batch, step, seed)
        grad[:] = 0
        loss, _ = model.loss_and_grad(params, x[idx], y[idx], 1 / batch, grad)
        opt.step(params, grad)
        losses.append(loss)
    held_out = model.loss(model.forward(params, x_out), y_out, 1 / N_HELD_OUT)
    return losses, float(held_out), params


SWEEP = (0.0125, 0.025, 0.05, 0.1)    # base lrs tried at batch 32: BASE_LR must be the best


def tune_base_lr(lab):
    """Batch BASE_BATCH for 10 epochs at every lr of SWEEP: the held-out
    loss of each (kept: the later steps compare with the best)."""
    if "l06" not in lab.scratch:
        lab.scratch["l06"] = {lr: train_minibatch(BASE_BATCH, lr, 10)
                              for lr in SWEEP}
    return lab.scratch["l06"]


def small_batch(lab):
    """The tuned small batch: what the later steps compare with."""
    return tune_base_lr(lab)[BASE_LR]


def scaled_runs(base_lr, k, epochs):
    """Held-out loss at batch k × BASE_BATCH for each lr rule from base_lr."""
    out = {}
    for rule in ("none", "sqrt", "linear"):
        lr = scaled_lr(base_lr, BASE_BATCH, k * BASE_BATCH, rule)
        out[rule] = (lr, train_minibatch(k * BASE_BATCH, lr, epochs)[1])
    return out


def same_samples_fewer_steps(lab):
    epochs, k = 10, 16
    sweep = {lr: run[1] for lr, run in tune_base_lr(lab).items()}
    tuned = min(sweep, key=sweep.get)
    small = small_batch(lab)
    big = scaled_runs(BASE_LR, k, epochs)
    held = {rule: loss for rule, (_, loss) in big.items()}
    best = min(held, key=held.get)
    # the same rules from an untuned base lr: twice the best
    rough = scaled_runs(2 * BASE_LR, k, epochs)
    rough_best = min(("sqrt", "linear"), key=lambda r: rough[r][1])
    return {"small": small[1], "small_steps": len(small[0]),
            "sweep": ", ".join(f"{h:.3f} at lr {lr:g}" for lr, h in sweep.items()),
            "tuned": tuned, "sweep_size": len(SWEEP),
            "big_steps": epochs * N_TRAIN // (k * BASE_BATCH), "epochs": epochs,
            "none": held["none"], "sqrt": held["sqrt"],
            "linear": held["linear"],
            "lr_sqrt": big["sqrt"][0], "lr_linear": big["linear"][0],
            "best": best, "best_loss": held[best], "k": k,
            "rough_lr": 2 * BASE_LR, "rough_held": sweep[2 * BASE_LR],
            "rough_sqrt": rough["sqrt"][1], "rough_linear": rough["linear"][1],
            "rough_lr_linear": rough["linear"][0], "rough_best": rough_best,
            "big_batch": k * BASE_BATCH,
            "base_lr": BASE_LR, "base_batch": BASE_BATCH,
            "n_train": N_TRAIN, "n_held_out": N_HELD_OUT}


def warm_up(lab):
    k, epochs, warmup_steps = 128, 30, 10
    batch = k * BASE_BATCH               # every training sample, every step
    lr = scaled_lr(BASE_LR, BASE_BATCH, batch, "linear")
    rows = {}
    for x in (1, 1.5, 2):                # the linear rule's lr, and past it
        cold, cold_end, _ = train_minibatch(batch, x * lr, epochs)
        warm, warm_end, _ = train_minibatch(batch, x * lr, epochs,
                                            warmup_steps)
        rows[x] = (x * lr, max(cold[:10]), max(warm[:10]),
                   cold_end, warm_end)
    table = "\n".join(f"| {r[0]:g} | {r[1]:.2f} | {r[2]:.2f} | {r[3]:.3f} "
                      f"| {r[4]:.3f} |" for r in rows.values())
    one, two = rows[1], rows[2]
    return {"start": cold[0], "k": k, "batch": batch, "table": table,
            "peaks_1": one[1:3], "cold_end_1": one[3], "warm_end_1": one[4],
            "lr_2": two[0], "cold_peak_2": two[1], "warm_peak_2": two[2],
            "cold_end_2": two[3], "warm_end_2": two[4],
            "warm_peaks": [r[2] for r in rows.values()],
            "small": small_batch(lab)[1], "epochs": epochs,
            "lr": lr, "warmup_steps": warmup_steps, "steps": len(cold),
            "base_lr": BASE_LR, "base_batch": BASE_BATCH}


def one_lr_per_layer(lab):
    cfg = TrainConfig(model=MODEL, dataset="classification",
                      num_samples=512, global_batch=512, steps=1)
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


GRIDS = {"momentum": (0.4, 0.8, 1.6),    # 0.8: the linear rule's, from 0.025
         "lars": (10, 20, 40), "lamb": (0.02, 0.04, 0.08)}


def lamb_step(params, grad, lr):
    """One LAMB update from ``params``: each tensor's trust ratio
    ‖w‖/‖u‖ and how far it moved, as a fraction of its norm."""
    model = MLP(MODEL)
    opt = make_optimizer(OptimConfig("lamb", lr=lr), model.num_params,
                         layers=model.param_slices)
    seen = []

    def norms(arrays):                   # what LAMB computes: kept
        seen.append(local_norms(arrays))
        return seen[-1]

    opt.norms = norms
    new = params.copy()
    opt.step(new, grad)
    k, norm = len(model.param_slices), np.linalg.norm
    w, u = seen[0][:k], seen[0][k:]
    moved = [float(norm(new[s] - params[s]) / norm(params[s]))
             for s in model.param_slices[0::2]]   # the weight matrices
    return [trust_ratio(a, b) for a, b in zip(w, u)], moved


def layerwise_run(lab):
    k, epochs, warmup = 32, 8, 2
    batch = k * BASE_BATCH
    held = {(opt, lr): train_minibatch(batch, lr, epochs, warmup, opt)[1]
            for opt, lrs in GRIDS.items() for lr in lrs}
    best = {opt: min(lrs, key=lambda lr: held[opt, lr])
            for opt, lrs in GRIDS.items()}
    end = {opt: held[opt, best[opt]] for opt in GRIDS}
    ranking = sorted(end, key=end.get)
    table = "\n".join(f"| {opt} | " + " | ".join(
        f"{lr:g}: {held[opt, lr]:.3f}" for lr in lrs) + " |"
        for opt, lrs in GRIDS.items())
    # LAMB's first update from the initial parameters, on a batch
    model = MLP(MODEL)
    (x, y), _ = split_data()
    params, grad = model.init_params(0), np.zeros(model.num_params)
    model.loss_and_grad(params, x[:batch], y[:batch], 1 / batch, grad)
    ratios, moved = lamb_step(params, grad, best["lamb"])
    norm, weights = np.linalg.norm, model.param_slices[0::2]
    sgd = [norm(params[w]) / norm(grad[w]) for w in weights]   # step 3's
    return {"batch": batch, "k": k, "epochs": epochs, "warmup": warmup,
            "steps": epochs * N_TRAIN // batch, "table": table,
            "interior": all(best[o] == lrs[1] for o, lrs in GRIDS.items()),
            "momentum": end["momentum"], "lars": end["lars"],
            "lamb": end["lamb"], "winner": ranking[0],
            "ranking": ", then ".join(ranking),
            "lr_lamb": best["lamb"], "lr_lars": best["lars"],
            "lr_momentum": best["momentum"],
            "linear_lr": scaled_lr(BASE_LR, BASE_BATCH, batch, "linear"),
            "w_ratios": ", ".join(f"{r:.3f}" for r in ratios[0::2]),
            "b_ratios": ", ".join(f"{r:g}" for r in ratios[1::2]),
            "ratio_list": ratios, "moved": moved,
            "moved_0": moved[0], "small": small_batch(lab)[1],
            "base_batch": BASE_BATCH, "spread": max(sgd) / min(sgd)}


STEPS = (
    Step(
        title="The same samples in fewer steps need a larger lr",
        text=("{n_train:,} training samples, {n_held_out:,} **held-out** ones the training never sees: "
              "a loss on them says how well the model does on new data, which a training loss cannot. "
              "A rule scales an lr, so first find the lr to scale: batch {base_batch} (SGD with momentum), "
              "{epochs} epochs (passes over the training samples, {small_steps:,} steps), at "
              "{sweep_size} lrs ends at held-out losses {sweep}. The best, **lr {base_lr:g}**, ends at "
              "**{small:.3f}**: it is the base every rule below scales.\n\n"
              "A global batch of {big_batch}, k = {k} times the small one ({k} ranks of {base_batch}, or "
              "any split of it: lesson 1), sees the same samples in {big_steps} steps. With the lr "
              "unchanged it ends at **{none:.3f}**: each step's gradient is an average over more samples "
              "(less noisy), but there are {k}x fewer steps. The **sqrt rule** (lr × √{k} = {lr_sqrt:g}) "
              "ends at {sqrt:.3f}; the **linear rule** (lr × {k} = {lr_linear:g}) at **{linear:.3f}**. "
              "From the tuned lr, {best} did best, as Goyal et al. (2017) found for SGD: k small steps "
              "move the parameters about as far as one step k times longer.\n\n"
              "Tune first, because a rule scales the base's error too. From an untuned base of "
              "{rough_lr:g}, twice the best (held-out {rough_held:.3f} at batch {base_batch}), the linear "
              "rule's lr {rough_lr_linear:g} ends at {rough_linear:.3f} and the sqrt rule's at "
              "{rough_sqrt:.3f}: a comparison from that base crowns {rough_best}, for the wrong reason. "
              "The linear rule holds only while k is small against the gradient's noise (lesson 13)."),
        run=same_samples_fewer_steps,
        checks=(Check("the base lr {base_lr:g} is the best of the {sweep_size} tried at batch {base_batch}",
                      lambda f: f["tuned"] == f["base_lr"]),
                Check("with the lr unchanged, the big batch ends behind the small one on held-out data",
                      lambda f: f["none"] > 1.2 * f["small"]),
                Check("both scaled lrs beat the unchanged one",
                      lambda f: max(f["sqrt"], f["linear"]) < f["none"]),
                Check("from the tuned base, the linear rule ends lowest", lambda f: f["best"] == "linear"),
                Check("the best scaled lr comes within 20% of the small batch's held-out loss",
                      lambda f: f["best_loss"] < 1.2 * f["small"]),
                Check("from twice the tuned base, the sqrt rule beats the linear one",
                      lambda f: f["rough_best"] == "sqrt")),
        inputs={"base_batch": BASE_BATCH, "base_lr": BASE_LR, "big_batch": 16 * BASE_BATCH},
        predict=Predict("Batch {base_batch} trains best with lr {base_lr:g}. By the linear rule, what lr "
                        "goes with a global batch of {big_batch}?", "lr_linear", rel_tol=1e-9,
                        misconceptions=((lambda g, f: abs(g - 4 * f["base_lr"]) < 1e-9,
                                         "that is the sqrt rule (lr × √16); the linear one is lr × 16"),
                                        (lambda g, f: abs(g - f["base_lr"]) < 1e-9,
                                         "that leaves the lr unchanged: 16x the batch, 16x the lr"))),
        hint="Linear: k times the batch, k times the lr (Goyal et al. 2017).",
        hints=("Here k = 512 / 32 = 16.",),
        show=(train_minibatch,),
        try_this="dplab compare --global-batches 64,256,1024 --lr-rule linear,sqrt,none --optimizer momentum",
        teaches=("lr-scaling", "large-batch-sgd"),
    ),
    Step(
        title="A large lr needs a warm-up",
        text=("Push k to {k}: a global batch of {batch:,}, every training sample in every step, and the "
              "linear rule's lr {base_lr:g} × {k} = **{lr:g}**. Train {epochs} epochs ({steps} steps) "
              "from a cold start and with a linear **warm-up** over the first {warmup_steps} updates "
              "(lr/{warmup_steps}, 2·lr/{warmup_steps}, ...), at that lr and past it (the training loss "
              "starts at {start:.2f}):\n\n"
              "| lr | peak loss, first 10 steps: cold | warm | held-out at the end: cold | warm |\n"
              "|---|---|---|---|---|\n{table}\n\n"
              "At the linear rule's {lr:g} this model needs no warm-up: the loss never climbs above its "
              "start, and the warm-up only costs its slow first steps ({cold_end_1:.3f} cold against "
              "{warm_end_1:.3f} warm). At {lr_2:g} the cold run's loss climbs to **{cold_peak_2:.2f}** in "
              "its first ten steps and ends at {cold_end_2:.3f}; warmed up, it never passes "
              "**{warm_peak_2:.2f}** and ends at {warm_end_2:.3f}. Early on the gradient changes fast, "
              "and the linear rule's assumption (k small steps ≈ one big step) does not hold yet: a "
              "warm-up widens the range of lrs that train. Goyal et al. needed one at k = 32 on ImageNet, "
              "where the linear rule's lr lay past that edge; here it lies inside. Still, batch "
              "{base_batch} reached {small:.3f} in 10 epochs, a third of these {epochs}: at this k the "
              "linear rule has broken down (lesson 13 measures where)."),
        run=warm_up,
        checks=(Check("at the linear rule's lr neither run climbs above its start",
                      lambda f: max(f["peaks_1"]) <= f["start"]),
                Check("there the warm-up only costs: the cold run ends lower",
                      lambda f: f["cold_end_1"] < f["warm_end_1"]),
                Check("at twice that lr the cold run's loss more than doubles its start in ten steps",
                      lambda f: f["cold_peak_2"] > 2 * f["start"]),
                Check("warmed up, no lr tried ever rises above its start",
                      lambda f: max(f["warm_peaks"]) <= f["start"]),
                Check("and at twice the lr the warmed-up run ends lower on held-out data",
                      lambda f: f["warm_end_2"] < f["cold_end_2"]),
                Check("but behind the small batch: the linear rule broke at k = {k}",
                      lambda f: f["warm_end_1"] > f["small"] and f["cold_end_1"] > f["small"])),
        inputs={"base_batch": BASE_BATCH, "base_lr": BASE_LR, "batch": 128 * BASE_BATCH},
        predict=Predict("Batch {base_batch} trains best with lr {base_lr:g}. What lr does the linear rule "
                        "give a batch of {batch:,}?", "lr", rel_tol=1e-9,
                        misconceptions=((lambda g, f: abs(g - f["base_lr"]) < 1e-9,
                                         "that leaves the lr unchanged: the linear rule multiplies it by "
                                         "k = 128"),)),
        hint="reference/lr.py: warmup_lr ramps from lr/warmup_steps at update 1 to the full lr.",
        try_this="dplab train --dataset classification --global-batch 512 --lr 0.8 --warmup-steps 10",
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
    Step(
        title="LAMB, run: Adam's step with a trust ratio, against LARS and SGD",
        text=("**LAMB** (You et al. 2020) takes Adam's direction u = m̂/(√v̂ + ε) and scales each "
              "tensor's step by its trust ratio ‖w‖/‖u‖, so every tensor moves by lr·‖w‖ per "
              "update. On this lesson's model, the first update from the start at lr {lr_lamb:g} "
              "has ratios {w_ratios} for the three weight matrices and {b_ratios} for the biases "
              "(their norm is 0 at the start: ratio 1, the papers' convention), and moved the "
              "weight matrices by {moved_0:.4g} of their norms: exactly lr.\n\nRun at a global "
              "batch of {batch:,} (k = {k}), {epochs} epochs ({steps} updates, a warm-up of "
              "{warmup}), each optimizer at three lrs, held-out loss at the end:\n\n| optimizer | "
              "lower lr | middle lr | higher lr |\n|---|---|---|---|\n{table}\n\nEach is best at "
              "the middle of its three lrs (tuned, not favoured). The order here: {ranking} "
              "(momentum SGD at the linear rule's lr {linear_lr:g}: **{momentum:.3f}**; LARS "
              "{lars:.3f}; LAMB {lamb:.3f}; batch {base_batch} reached {small:.3f} in 10 epochs). "
              "The layer-wise optimizers do not win on this model: its three weight matrices' "
              "‖w‖/‖g‖ at the start differ by {spread:.1f}x at most (step 3), not the orders of "
              "magnitude of a deep network, so a per-tensor ratio has little to correct. You et "
              "al. needed LAMB to train BERT at a batch of 32k and LARS for ResNet-50; Nado et al. "
              "(2021) later matched both with carefully tuned Nesterov momentum and Adam. A "
              "layer-wise optimizer is a tool for deep models at huge batches, not a free gain."),
        run=layerwise_run,
        checks=(Check("every optimizer's best lr lies inside its grid",
                      lambda f: f["interior"]),
                Check("momentum's best is the linear rule's lr",
                      lambda f: f["lr_momentum"] == f["linear_lr"]),
                Check("LAMB moves every weight matrix by lr of its norm (to 1e-9)",
                      lambda f: all(abs(m - f["lr_lamb"]) < 1e-9 * f["lr_lamb"]
                                    for m in f["moved"])),
                Check("a bias whose norm is 0 gets trust ratio 1",
                      lambda f: all(r == 1.0 for r in f["ratio_list"][1::2])),
                Check("the weight matrices' ‖w‖/‖g‖ differ by less than 10x",
                      lambda f: f["spread"] < 10),
                Check("on this model tuned momentum SGD ends lowest, LAMB highest",
                      lambda f: f["winner"] == "momentum" and f["lamb"] > f["lars"])),
        predict=Predict("LAMB scales each tensor's step by ‖w‖/‖u‖. At lr {lr_lamb:g}, by what "
                        "fraction "
                        "of its own norm does a weight matrix move in one update?", "moved_0",
                        rel_tol=1e-6,
                        misconceptions=((lambda g: abs(g - 1) < 1e-9, "that is a step as long as "
                                                                      "the tensor "
                                         "itself: the trust ratio makes the step lr·‖w‖, a "
                                         "fraction lr"),)),
        hint="w ← w - lr·(‖w‖/‖u‖)·u: take the norm of the change.",
        show=(lamb_step, "dplab.reference.optim.LAMB._update"),
        try_this=("dplab train --dataset classification --optimizer lamb --lr 0.04 "
                  "--global-batch 1024"),
        teaches=("lr-scaling",),
    ),
)

LESSON = Lesson(6, "large_batches", "Learning-rate scaling, warm-up, LARS and LAMB",
                "How the lr must change when data parallelism makes the global batch large.", STEPS)
