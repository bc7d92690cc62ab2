"""Lesson 10: memory. Replicas vs ZeRO-1/2/3 (and FSDP), and when data parallelism is not enough.

    dplab lesson 10

Nine steps: what each rank holds under ZeRO stages 0-3 against the closed forms; the bytes each
stage sends per step; activations, which ZeRO-1/2/3 leave whole, and checkpointing, which trades a
recompute for them; the 7B example of ``dplab memory``; a model data parallelism alone cannot
fit; two exercises: a ZeRO-2 step during backward, and an FSDP unit's gather and free; and
gradient clipping by the global norm of a sharded gradient, shown, then an exercise.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np

from dplab.backends.cli.memory import memory_rows
from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.exercises import STUBS, check_file
from dplab.lessons.exercises.fsdp_unit import HINTS as FSDP_HINTS
from dplab.lessons.exercises.sharded_clip import FACTORS as CLIP_FACTORS
from dplab.lessons.exercises.sharded_clip import HINTS as CLIP_HINTS
from dplab.lessons.exercises.sharded_clip import WORLD_SIZES as CLIP_WORLD_SIZES
from dplab.lessons.exercises.zero2 import HINTS as ZERO2_HINTS
from dplab.lessons.exercises.zero2 import MODEL as ZERO2_MODEL
from dplab.lessons.exercises.zero2 import in_flight_bytes
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.collectives import reduce_scatter
from dplab.reference.data import batch_indices, shard
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, setup
from dplab.reference.zero.clip import clip_coef, clip_grad_norm
from dplab.reference.zero.layers import layer_delta, layer_forward, layer_grads, output_delta
from dplab.reference.zero.memory import GB, model_state_bytes
from dplab.reference.zero.traffic import collective_sent, sent_closed_form, sent_per_step

__all__ = ["LESSON"]

# Seven layers (544, 6 x 1056, 132 parameters), each divisible by 4: every rank owns exactly 1/4
MODEL = MLPConfig(in_dim=16, hidden=(32,) * 6, out_dim=4)
TRAIN = TrainConfig(model=MODEL, steps=2, optimizer=OptimConfig("adam", lr=0.01))
KB, MIB, DEVICE_GB = 1024, 2**20, 80          # one 80 GB accelerator (GB = 1e9 bytes, as the calculator)
# activations: 16 layers 32 wide at a micro-batch of 1,024 (float64)
ACT_MODEL, ACT_BATCH = MLPConfig(in_dim=32, hidden=(32,) * 15, out_dim=32), 1024


def layer_sizes(model):
    net = MLP(model)
    slices = [net.layer_slice(layer) for layer in range(net.num_layers)]
    return [s.stop - s.start for s in slices]


def two_layers(sizes):
    """The largest two neighbouring layers: what ZeRO-2/3 hold whole
    while they are in flight."""
    return max(a + b for a, b in zip(sizes, sizes[1:]))


def measured_memory(lab):
    sizes, p = layer_sizes(MODEL), 4
    psi, rows = sum(sizes), {}
    for stage in (0, 1, 2, 3):
        spec = RunSpec(world_size=p, zero_stage=stage, train=TRAIN)
        row, _ = run_train(spec, world=lab.world(p))
        # float64 Adam: 8 + 8 + 16 bytes a parameter
        form = model_state_bytes(psi, stage, p, param_bytes=8,
                                 grad_bytes=8, state_bytes=16)
        rows[stage] = {"params": row["peak_params_bytes"],
                       "grads": row["peak_grads_bytes"],
                       "optimizer": row["peak_optimizer_bytes"],
                       "total": row["peak_total_bytes"],
                       "form": form,
                       "diff": row["max_abs_diff_vs_single"]}

    def line(s, r):
        kb = [r[k] / KB for k in ("params", "grads", "optimizer", "total")]
        cells = [f"{x:.1f}" for x in (*kb, r["form"].total / KB)]
        return f"| {s} | " + " | ".join(cells) + " |"

    flight = 8 * two_layers(sizes)
    return {"p": p, "psi": psi, "layers": len(sizes), "rows": rows,
            "table": "\n".join(line(s, r) for s, r in rows.items()),
            "flight": flight,
            "flight_kb": flight / KB,
            "opt_fraction": rows[1]["optimizer"] / rows[0]["optimizer"],
            "saving": rows[0]["total"] / rows[3]["total"]}


def sent_per_stage(lab):
    p, psi = 4, sum(layer_sizes(MODEL))
    sent, events = {}, []
    for stage in (0, 1, 2, 3):
        spec = RunSpec(world_size=p, zero_stage=stage, train=TRAIN)
        _, events = run_train(spec, world=lab.world(p), trace=True)
        # bytes, per rank per step
        sent[stage] = [sent_per_step(events[rank], rank)
                       for rank in range(p)]
    # float64: 8 bytes an element
    form = {s: sent_closed_form(s, psi, p) * 8 for s in sent}
    table = "\n".join(f"| {s} | {v[0][0]:,} | {form[s]:,.0f} |"
                      for s, v in sent.items())
    return {"p": p, "psi": psi, "sent": sent, "form": form,
            "rank0": {s: v[0][0] for s, v in sent.items()},
            "ratio": sent[3][0][0] / sent[0][0][0],
            # the last run's: stage 3
            "events": events,
            "kinds": {e.kind for rank in events for e in rank},
            "table": table}


# the timeline draws kinds it has no colour for in one grey: these two must differ
COLLECTIVE_COLORS = {"allgather": "#4C78A8", "reduce_scatter": "#E45756"}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    fig = timeline_figure([e for rank in facts["events"] for e in rank],
                          title=f"ZeRO stage 3 on {facts['p']} ranks: all-gathers (blue) and "
                                "reduce-scatters (red) per layer")
    for kind, color in COLLECTIVE_COLORS.items():
        fig.update_traces(marker_color=color, selector={"name": kind})
    return fig


def seven_billion(lab):
    stages = [0, 1, 2, 3]
    # `dplab memory`'s rows
    rows = memory_rows(7_000_000_000, "adam", "mixed", stages, [1, 8, 64])
    # ZeRO's Figure 1
    paper = memory_rows(7_500_000_000, "adam", "mixed", stages, [64])
    at = {(r["world_size"], r["stage"]): r["total_gb"] for r in rows}
    table = "\n".join(
        f"| {n} | " + " | ".join(f"{at[n, s]:.1f}" for s in stages) + " |"
        for n in (1, 8, 64))
    r0 = rows[0]
    per_param = r0["param_bytes"] + r0["grad_bytes"] + r0["state_bytes"]
    paper_gb = [round(r["total_gb"], 1) for r in paper]
    return {"per_param": per_param,
            "k": r0["state_bytes"],
            "replicated": at[1, 0],
            "stage3_8": at[8, 3],
            "weights_gb": r0["params_gb"],
            "optimizer_gb": r0["optimizer_gb"],
            "table": table,
            "paper": paper_gb,
            "device": DEVICE_GB,
            "paper_text": ", ".join(f"{gb:g}" for gb in paper_gb)}


def beyond_data_parallel(lab):
    # one trillion parameters, mixed-precision Adam
    psi, per_rank = 1_000_000_000_000, DEVICE_GB * GB
    # data parallel only: 8 ranks at stage 3
    zero3_8 = model_state_bytes(psi, 3, 8)
    # the ranks ZeRO-3 alone would need
    need = math.ceil(model_state_bytes(psi, 0, 1).total / per_rank)
    # each rank: 1/(8 x 16) of the weights ...
    tensor, pipeline, data = 8, 16, 8
    # ... and ZeRO-1 over 8 replicas
    three_d = model_state_bytes(psi / (tensor * pipeline), 1, data)
    return {"psi_t": psi / 1e12, "device": DEVICE_GB,
            "zero3_8_gb": zero3_8.total / GB,
            "weights_8_gb": zero3_8.params / GB,
            "need": need,
            "tensor": tensor, "pipeline": pipeline, "data": data,
            "gpus": tensor * pipeline * data,
            "three_d_gb": three_d.total / GB,
            "share": psi / (tensor * pipeline) / 1e9}


def _stage_bars(facts):
    from dplab.lessons.pictures_terminal import memory_bars
    return memory_bars({f"stage {s}": {k: r[k] for k in ("params", "grads", "optimizer")}
                        for s, r in facts["rows"].items()})


def _activation_bars(facts):
    from dplab.lessons.pictures_terminal import memory_bars
    states = {"params": facts["param_bytes"], "grads": facts["param_bytes"],
              "optimizer": 2 * facts["param_bytes"]}
    from rich.console import Group
    from rich.text import Text

    from dplab.lessons.plain import size
    plain, ckpt = facts["peak_plain_mib"] * MIB, facts["peak_ckpt_mib"] * MIB
    bars = memory_bars({"all inputs kept": states | {"activations": plain},
                        f"every {facts['every']}th kept": states | {"activations": ckpt}})
    # the text's peaks are the activations alone: say why the bars are longer
    said = Text(f"Each bar adds the model states ({size(sum(states.values()))}: weights, gradient and "
                f"Adam's two moments) to the activation peak in the text ({facts['peak_plain_mib']:.1f} MiB "
                f"and {facts['peak_ckpt_mib']:.1f} MiB).",
                style="dim")
    return Group(said, bars)


def train_step(model, w, x, y, every, grads):
    """One forward and backward, layer by layer, keeping the input of
    every ``every``-th layer (1: all of them); the others are
    recomputed from the last kept one when backward needs them.
    Adds into ``grads`` (a view per layer); returns how many layer
    forwards ran."""
    L, runs = model.num_layers, 0
    kept, a = {}, x
    for layer in range(L):
        if layer % every == 0:
            kept[layer] = a
        a = layer_forward(model, layer, w[layer], a)
        runs += 1
    delta = output_delta(model, a, y, 1 / len(x))
    for start in reversed(range(0, L, every)):
        # recompute the segment's inputs from its checkpoint
        seg = [kept.pop(start)]
        for layer in range(start, min(start + every, L) - 1):
            seg.append(layer_forward(model, layer, w[layer], seg[-1]))
            runs += 1
        for layer in reversed(range(start, start + len(seg))):
            a = seg.pop()
            layer_grads(model, layer, a, delta, grads[layer])
            if layer:
                delta = layer_delta(model, layer, w[layer], a, delta)
    return runs


def measured(model, w, x, y, every):
    """The step's peak allocation beyond the weights and gradient,
    which exist before it: its activations and their scratch."""
    flat = np.zeros(model.num_params)
    grads = [flat[model.layer_slice(i)] for i in range(len(w))]
    tracemalloc.start()
    runs = train_step(model, w, x, y, every, grads)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return flat, runs, peak


def activations_and_checkpoints(lab):
    model = MLP(ACT_MODEL)
    flat = model.init_params(seed=0)
    w = [flat[model.layer_slice(i)] for i in range(model.num_layers)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ACT_BATCH, ACT_MODEL.in_dim))
    y = rng.standard_normal((ACT_BATCH, ACT_MODEL.out_dim))
    plain, runs_plain, peak_plain = measured(model, w, x, y, 1)
    every = 4
    ckpt, runs_ckpt, peak_ckpt = measured(model, w, x, y, every)
    L, width = model.num_layers, ACT_MODEL.hidden[0]
    act = ACT_BATCH * width * 8
    # Adam in float64: weights, gradient, two moments
    states = model.num_params * 8 * 4
    return {"L": L, "batch": ACT_BATCH, "width": width,
            "act_kib": act / KB, "every": every,
            "param_bytes": model.num_params * 8,
            "acts_mib": L * act / MIB,
            "states_mib": states / MIB,
            "peak_plain_mib": peak_plain / MIB,
            "peak_ckpt_mib": peak_ckpt / MIB,
            "saving": peak_plain / peak_ckpt,
            "runs_plain": runs_plain, "runs_ckpt": runs_ckpt,
            "extra": runs_ckpt - runs_plain,
            "same": bool(np.array_equal(plain, ckpt)),
            "right": bool(np.allclose(plain, reference_grad(model, flat, x, y), rtol=1e-12, atol=0))}


def reference_grad(model, flat, x, y):
    grad = np.zeros_like(flat)
    model.loss_and_grad(flat, x, y, 1 / len(x), grad)
    return grad


def zero2_exercise(lab):
    sizes = layer_sizes(ZERO2_MODEL)
    n, p = sum(sizes), 4
    # rank r owns chunk r of every layer
    owns = chunk_bounds(sizes[1], p)
    # what `dplab lesson check 10` says of the stub
    stub = check_file("zero2_step", STUBS / "zero2_step.py")
    return {"n": n, "p": p, "layers": len(sizes),
            "layer": sizes[1],
            "owns": ", ".join(f"rank {r}: [{a}:{b}]"
                              for r, (a, b) in enumerate(owns)),
            "rank2_start": owns[2][0],
            "whole_kib": 8 * n / KB,
            "allowed_kib": in_flight_bytes(sizes) / KB,
            "stub_passed": stub.passed,
            "stub_says": stub.message}


def fsdp_exercise(lab):
    # what `dplab lesson check 10` says of the FSDP stub
    stub = check_file("fsdp_unit", STUBS / "fsdp_unit.py")
    return {"stub_passed": stub.passed, "stub_says": stub.message,
            "collectives": 3}


def clip_rank(comm, max_norm):
    """One rank after ZeRO-2's reduce-scatters: its chunk of every
    layer's summed gradient, clipped by the global norm."""
    model, data, init = setup(TRAIN)
    batch = batch_indices(TRAIN.num_samples, TRAIN.global_batch, 0, 0)
    mine = shard(batch, comm.rank, comm.world_size)
    grad = np.zeros_like(init)  # this rank's samples, scaled 1/global batch
    model.loss_and_grad(init, data.x[mine], data.y[mine],
                        1 / TRAIN.global_batch, grad)
    chunks = []
    for layer in range(model.num_layers):
        g = grad[model.layer_slice(layer)]
        reduce_scatter(comm, g)       # my chunk of g now holds the sum
        a, b = chunk_bounds(len(g), comm.world_size)[comm.rank]
        chunks.append(g[a:b].copy())
    own = float(np.sqrt(sum(c @ c for c in chunks)))
    total = clip_grad_norm(comm, chunks, max_norm)
    return own, total, np.concatenate(chunks)


def clipping_a_shard(lab):
    p, max_norm = 4, 1.0
    model, data, init = setup(TRAIN)
    batch = batch_indices(TRAIN.num_samples, TRAIN.global_batch, 0, 0)
    full = np.zeros_like(init)      # one device: the whole gradient
    model.loss_and_grad(init, data.x[batch], data.y[batch],
                        1 / TRAIN.global_batch, full)
    norm = float(np.linalg.norm(full))
    ranks = lab.world(p).run(clip_rank, max_norm)
    own = [r[0] for r in ranks]
    # the one-device clip, cut into the same chunks as the ranks hold
    clipped = full * clip_coef(norm, max_norm)
    cut = [chunk_bounds(model.layer_slice(i).stop - model.layer_slice(i).start, p)
           for i in range(model.num_layers)]
    want = [np.concatenate([clipped[model.layer_slice(i)][slice(*c[r])]
                            for i, c in enumerate(cut)]) for r in range(p)]
    diff = max(float(np.abs(r[2] - w).max()) for r, w in zip(ranks, want))
    # the common bug: every rank clips by its own shard's norm
    wrong = [clip_coef(n, max_norm) for n in own]
    bug = np.concatenate([w / clip_coef(norm, max_norm) * c
                          for w, c in zip(want, wrong)])
    right = np.concatenate(want)
    cos = float(bug @ right / np.linalg.norm(bug) / np.linalg.norm(right))
    sent = [8 * collective_sent("allreduce", "ring", p, r, 1) for r in range(p)]
    grad_bytes = 8 * sum(collective_sent("reduce_scatter", "ring", p, 0,
                                         s.stop - s.start)
                         for s in (model.layer_slice(i) for i in range(model.num_layers)))
    return {"p": p, "max_norm": max_norm, "own": own,
            "shards": ", ".join(f"{n:.4f}" for n in own),
            "total": ranks[0][1], "norm": norm,
            "same_everywhere": all(r[1] == ranks[0][1] for r in ranks),
            "diff": diff, "coef": clip_coef(norm, max_norm),
            "wrong": ", ".join(f"{c:.3f}" for c in wrong),
            "wrong_list": wrong, "cos": cos,
            "bug_norm": float(np.linalg.norm(bug)),
            "angle": float(np.degrees(np.arccos(min(cos, 1.0)))),
            "sum_norms": sum(own), "norm_bytes": max(sent),
            "grad_bytes": grad_bytes}


def clip_exercise(lab):
    # what `dplab lesson check 10` says of the clipping stub
    stub = check_file("sharded_clip", STUBS / "sharded_clip.py")
    return {"stub_passed": stub.passed, "stub_says": stub.message,
            "first": CLIP_WORLD_SIZES[0], "last": CLIP_WORLD_SIZES[-1],
            "low": CLIP_FACTORS[0], "high": CLIP_FACTORS[1]}


STEPS = (
    Step(
        title="What each rank holds: replicas vs ZeRO-1, 2, 3",
        text=("Plain data parallelism keeps on every rank all the weights, all the gradients and the whole "
              "optimizer state: p ranks, p copies. ZeRO (Rajbhandari et al. 2020) keeps only what a rank "
              "needs: stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the weights "
              "too. Measured by the trainer's memory ledger, the busiest of p={p} ranks, float64 Adam, "
              "{psi:,} parameters in {layers} layers (KiB):\n\n"
              "| stage | params | grads | optimizer | total | formula total |\n|---|---|---|---|---|---|\n"
              "{table}\n\n"
              "Stage 0 is the closed form exactly; each sharded part is the formula's 1/p exactly. What "
              "stages 2 and 3 hold beyond the formula is the layers in flight: a layer's gradient while it "
              "is reduce-scattered and the next is computed, a layer's weights while they are gathered and "
              "used ({flight_kb:.1f} KiB, the two largest neighbouring layers). With {layers} layers that is "
              "a large share; two of a hundred equal layers would be 2% of the weights. Every stage "
              "trains the same model as one device; stage 3 holds {saving:.1f}x less than stage 0."),
        run=measured_memory,
        picture=_stage_bars,
        checks=(Check("stage 0 holds exactly the closed form",
                      lambda f: (f["rows"][0]["params"], f["rows"][0]["grads"], f["rows"][0]["optimizer"])
                      == (f["rows"][0]["form"].params, f["rows"][0]["form"].grads,
                          f["rows"][0]["form"].optimizer)),
                Check("stages 1-3 hold exactly 1/p of the optimizer state",
                      lambda f: all(f["rows"][s]["optimizer"] == f["rows"][s]["form"].optimizer
                                    for s in (1, 2, 3))),
                Check("sharded gradients (2, 3) and weights (3) are 1/p plus the two layers in flight",
                      lambda f: all(f["rows"][s]["grads"] == f["rows"][s]["form"].grads + f["flight"]
                                    for s in (2, 3))
                      and f["rows"][3]["params"] == f["rows"][3]["form"].params + f["flight"]),
                Check("each stage holds less than the one before",
                      lambda f: f["rows"][0]["total"] > f["rows"][1]["total"] > f["rows"][2]["total"]
                      > f["rows"][3]["total"]),
                Check("and every stage trains as one device does (< 1e-12)",
                      lambda f: all(r["diff"] < 1e-12 for r in f["rows"].values()))),
        inputs={"p": 4},
        predict=Predict("At ZeRO stage 1 on {p} ranks, what fraction of stage 0's optimizer state does a "
                        "rank hold?", "opt_fraction", rel_tol=0.01,
                        misconceptions=((1.0, "stage 1 shards exactly the optimizer state: each rank keeps "
                                         "its own 1/p"),)),
        show=("dplab.reference.zero.memory.model_state_bytes",),
        hint="Stage 1: rank r updates only the r-th 1/p of the parameters, so it keeps state for those.",
        try_this="dplab train --zero-stage 3 --world-size 4 --optimizer adam   # rows carry peak_*_bytes",
        teaches=("memory",),
    ),
    Step(
        title="What sharding costs: bytes per step",
        text=("Memory saved is communication paid. From the trace, the bytes rank 0 sent in one step at "
              "p={p} against the closed form (ring: (p-1)/p of the vector per reduce-scatter or "
              "all-gather):\n\n"
              "| stage | rank 0 sent | formula |\n|---|---|---|\n{table}\n\n"
              "Stages 1 and 2 send what plain data parallelism sends: an all-reduce *is* a reduce-scatter "
              "then an all-gather, and ZeRO only moves the optimizer step in between. Stage 3 gathers each "
              "layer's weights twice (forward and backward) and reduce-scatters its gradient: "
              "**{ratio:g}x** the bytes. torch's FSDP, and dplab's own wrapper with its API "
              "(`backends/nn/fsdp.py`, lesson 14), are stage 3 for torch modules, with the same three "
              "collectives."),
        run=sent_per_stage,
        figure=_timeline,
        checks=(Check("every rank sent exactly the closed form, every step, at every stage",
                      lambda f: all(b == f["form"][s] for s, ranks in f["sent"].items() for r in ranks
                                    for b in r)),
                Check("stages 1 and 2 send what stage 0 sends",
                      lambda f: f["rank0"][0] == f["rank0"][1] == f["rank0"][2]),
                Check("stage 3 sends 1.5x", lambda f: f["ratio"] == 1.5),
                Check("the figure draws all-gathers and reduce-scatters in two colours",
                      lambda f: f["kinds"] >= {"allgather", "reduce_scatter"})),
        predict=Predict("Per step, how many times the bytes of plain data parallelism does ZeRO stage 3 "
                        "send?", "ratio", rel_tol=0.01, unit="x",
                        misconceptions=((1.0, "stage 3 must gather the weights before backward too: one "
                                         "more all-gather than an all-reduce's halves"),
                                        (2.0, "an all-reduce is already a reduce-scatter plus an all-gather; "
                                         "stage 3 adds one all-gather, half an all-reduce"))),
        show=("dplab.reference.zero.traffic.sent_closed_form",),
        hint="Count the collectives: all-reduce = reduce-scatter + all-gather; stage 3 adds one all-gather.",
        try_this="dplab train --zero-stage 3 --world-size 4 --trace z3.json   # every send is in the trace",
        teaches=("memory",),
    ),
    Step(
        title="Activations beside the model states, and checkpointing",
        text=("A rank holds four things: weights, gradients and optimizer state (the model states ZeRO-1, "
              "2 and 3 shard) and the **activations** its backward needs: every layer's input, kept from "
              "forward. They grow with the micro-batch, the depth and the width (in a transformer also "
              "with the sequence length, and attention's scores with its square), not with the parameter "
              "count as such, and sharding the model states leaves them where they are. The ZeRO paper's "
              "ZeRO-R handles them separately: where tensor model parallelism leaves every rank of a "
              "group holding the same activations, it partitions the activation checkpoints across the "
              "group and can offload them to CPU memory. Here {L} layers {width} wide at a micro-batch "
              "of {batch:,}: each layer's input is {batch:,} × {width} × 8 bytes = {act_kib:.0f} KiB, "
              "{acts_mib:.1f} MiB in all, against "
              "{states_mib:.1f} MiB of model states (Adam, float64). Measured (tracemalloc, one forward and "
              "backward, beyond the weights and gradient already there): the step's peak is "
              "**{peak_plain_mib:.1f} MiB**.\n\n"
              "**Activation checkpointing** keeps only every {every}th layer's input and recomputes the "
              "others from it, one segment at a time, when backward reaches them: the peak falls to "
              "**{peak_ckpt_mib:.1f} MiB** (about half: {saving:.2f}x less), for {extra} more layer forwards "
              "({runs_ckpt} instead of {runs_plain}: most of a second forward pass), and the gradient is "
              "the same to the bit ({same}). A checkpoint every sqrt(L) layers is the classic balance "
              "(Chen et al. 2016); torch's `torch.utils.checkpoint` does this to any module."),
        run=activations_and_checkpoints,
        picture=_activation_bars,
        checks=(Check("the gradient is the model's (loss_and_grad) to 1e-12", lambda f: f["right"]),
                Check("checkpointing changes no bit of the gradient", lambda f: f["same"]),
                Check("and about halves the step's peak memory (more than 1.8x less)",
                      lambda f: f["saving"] > 1.8),
                Check("at the price of recomputing every layer but one in each segment's first",
                      lambda f: f["extra"] == f["L"] - f["L"] // f["every"]),
                Check("each layer's input is micro-batch × width × 8 bytes (float64)",
                      lambda f: f["act_kib"] * 1024 == f["batch"] * f["width"] * 8),
                Check("the activations outweigh the model states here",
                      lambda f: f["acts_mib"] > f["states_mib"])),
        inputs={"L": 16, "every": 4},
        predict=Predict("{L} layers, a checkpoint every {every} layers: how many layer forwards does one "
                        "step run, recomputation included (without checkpoints: {L})?", "runs_ckpt",
                        misconceptions=((32, "the first layer of each segment need not be recomputed: its "
                                         "input is the checkpoint"),
                                        (20, "each segment recomputes the inputs of all its layers but "
                                         "the first, not one layer"))),
        hint="Each segment of 4 layers keeps its first input; backward recomputes the other 3.",
        show=(train_step,),
        try_this="python -c \"import torch.utils.checkpoint as c; help(c.checkpoint)\"",
        teaches=("memory", "activations"),
    ),
    Step(
        title="The 7B example",
        text=("Scale it up with the same formulas: `dplab memory` for 7 billion parameters, Adam in mixed "
              "precision: {per_param} bytes per parameter (2 for fp16 weights, 2 for gradients, and what the "
              "ZeRO paper calls K, the optimizer's bytes per parameter: K = {k} for the fp32 master copy "
              "(4) and Adam's two moments (4 + 4)). Per rank, model states only, in GB as the paper "
              "prints them (10^9 bytes; the sizes measured above are KiB and MiB, 2^10 and 2^20):\n\n"
              "| ranks | stage 0 | stage 1 | stage 2 | stage 3 |\n|---|---|---|---|---|\n{table}\n\n"
              "Replicated, every rank needs **{replicated:.0f} GB** before a single activation, which no "
              "{device} GB accelerator holds, however many of them there are: the weights are only "
              "{weights_gb:.0f} GB of it, the optimizer state {optimizer_gb:.0f} GB. Stage 3 on 8 ranks "
              "makes it {stage3_8:.0f} GB. The paper's Figure 1 (7.5B, 64 ranks) comes out as printed there: "
              "{paper_text} GB for stages 0-3."),
        run=seven_billion,
        checks=(Check("16 bytes per parameter: 112 GB replicated, whatever the number of ranks",
                      lambda f: f["per_param"] == 16 and f["replicated"] == 112),
                Check("stage 3 on 8 ranks: 14 GB", lambda f: f["stage3_8"] == 14),
                Check("the ZeRO paper's Figure 1: 120, 31.4, 16.6, 1.9 GB",
                      lambda f: f["paper"] == [120.0, 31.4, 16.6, 1.9])),
        predict=Predict("7B parameters, Adam in mixed precision (2 + 2 + 12 bytes per parameter), plain data "
                        "parallelism: how many GB of model states per rank?", "replicated", rel_tol=0.01,
                        unit="GB"),
        hint="Data parallelism replicates: the number of ranks does not enter.",
        show=("dplab.reference.zero.memory.model_state_bytes",),
        try_this="dplab memory --params 7.5B --world-sizes 64   # the ZeRO paper's Figure 1",
        teaches=("memory",),
    ),
    Step(
        title="When data parallelism is not enough",
        text=("Take {psi_t:g} trillion parameters, mixed-precision Adam, {device} GB per accelerator. Data "
              "parallelism on a node of 8 at stage 3 needs **{zero3_8_gb:,.0f} GB** per rank; the weights "
              "alone are {weights_8_gb:,.0f} GB. Sharding divides by the number of replicas, so ZeRO-3 "
              "alone fits only from {need} ranks on, and every one of them must be a replica with its own "
              "samples: a global batch of at least {need}, chosen by memory rather than by what trains well "
              "(lesson 6). And stage 3 still gathers each layer whole (step 1's layers in flight), and "
              "activations are not sharded at all.\n\n"
              "So large models split the *model*: pipeline parallelism gives each rank a run of layers, "
              "tensor parallelism a slice of each layer's matrices. With {tensor}-way tensor and "
              "{pipeline}-way pipeline parallelism each rank holds {share:.2f}B parameters; the same "
              "calculator then gives **{three_d_gb:.1f} GB** per rank at ZeRO-1 over {data} replicas, "
              "{gpus} accelerators in all (an even split assumed; activations on top)."),
        run=beyond_data_parallel,
        checks=(Check("ZeRO-3 over 8 ranks: the weights alone exceed one device",
                      lambda f: f["weights_8_gb"] > f["device"]),
                Check("ZeRO-3 alone needs hundreds of ranks to fit", lambda f: f["need"] >= 100),
                Check("split 128 ways by tensor x pipeline parallelism, ZeRO-1 over 8 fits",
                      lambda f: f["three_d_gb"] < f["device"])),
        inputs={"psi_t": 1, "device": DEVICE_GB},
        predict=Predict("{psi_t:g} trillion parameters at 16 bytes each: how many ranks does ZeRO-3 alone "
                        "need to fit the model states in {device} GB per rank?", "need",
                        misconceptions=((25, "that fits the weights alone (2 bytes each); gradients and "
                                         "Adam's float32 state are 14 more bytes a parameter"),
                                        (13, "that counts a byte a parameter (1 TB); each takes 16 "
                                         "bytes: 16 TB of model states"))),
        hint="Stage 3 divides all of it (weights, gradients, state) by the number of ranks: total / device.",
        try_this="dplab memory --params 1T --world-sizes 8,200 --stages 0,3",
        teaches=("beyond-dp",),
    ),
    Step(
        title="Exercise: a ZeRO-2 step, during backward",
        text=("Now write ZeRO-2 as the engine runs it. `dplab lesson init DIR` copies the stubs; fill in "
              "`zero2_step(comm, backward, params, shard, optimizer)` in DIR/zero2_step.py and run "
              "`dplab lesson check 10 DIR`. `backward` is the real backward pass of a {layers}-layer model "
              "({n:,} parameters), one layer at a time, last layer first; each layer's gradient arrives "
              "in a fresh buffer.\n\n"
              "ZeRO-2 reduce-scatters each layer's gradient **the moment backward yields it**, keeps its "
              "own chunk (a layer of {layer:,} parameters at p={p}: {owns}) and drops the buffer, so it "
              "never holds the whole gradient; after backward it steps its chunks and all-gathers each "
              "layer's weights. The check runs your step on 1 to 4 ranks and judges three things: every "
              "rank's weights against one device; the bytes sent (a reduce-scatter and an all-gather per "
              "layer: an all-reduce in their place trains just as well and sends 1.5x); and the peak "
              "memory of the step ({whole_kib:.0f} KiB is the whole gradient; the check allows "
              "{allowed_kib:.0f} KiB, which a few layers in flight never reach). The stub is plain data "
              "parallelism (every layer all-reduced and kept); checking it as shipped says:\n\n"
              "> {stub_says}"),
        run=zero2_exercise,
        checks=(Check("the stub fails its check, naming the whole gradient it held",
                      lambda f: not f["stub_passed"] and "whole gradient" in f["stub_says"]),),
        inputs={"layer": 1056, "p": 4},
        predict=Predict("A layer of {layer:,} parameters on {p} ranks: at which index of the layer does "
                        "rank 2's chunk start?", "rank2_start",
                        misconceptions=((lambda g, f: g == f["layer"] // 2 - 1, "off by one: chunks start "
                                         "at 0, so rank 2's starts after ranks 0 and 1's chunks"),
                                        (lambda g, f: g == 2, "that is the rank, not the index: each rank's "
                                         "chunk holds layer / p parameters"))),
        hint=ZERO2_HINTS[0],
        hints=ZERO2_HINTS[1:],
        show=("dplab.reference.zero.layout.ShardLayout",),
        try_this="dplab lesson init ex && dplab lesson check 10 ex   # edit ex/zero2_step.py until it passes",
        exercise="zero2_step",
        teaches=("memory",),
    ),
    Step(
        title="Exercise: an FSDP unit's gather and free",
        text=("Stage 3 (FSDP) keeps only a shard of every unit's weights. Write the two moves around one "
              "unit in DIR/fsdp_unit.py: `unit_forward(comm, shard, n, forward)` all-gathers the unit's "
              "weights, runs `forward(w)` and lets `w` go; `unit_backward(comm, shard, n, backward, "
              "grad_shard)` gathers them again, takes the unit's gradient from `backward(w)`, "
              "reduce-scatters it and keeps only this rank's chunk. `dplab lesson check 10 DIR` runs a "
              "model of 8 units on 1 to 4 ranks and judges every call: its output and gradient chunk "
              "against the true ones, the bytes it sent (forward: one all-gather; backward: an all-gather "
              "and a reduce-scatter), and what it left allocated when it returned: weights kept from "
              "forward for backward save a gather and cost a whole unit per rank, which is what FSDP "
              "exists to free. The stub does not gather at all; checked as shipped it says:\n\n"
              "> {stub_says}"),
        run=fsdp_exercise,
        checks=(Check("the stub fails its check, naming the wrong weights its forward ran with",
                      lambda f: not f["stub_passed"] and "whole weights" in f["stub_says"]),),
        inputs={},
        predict=Predict("How many collectives does one unit take per training step under FSDP (forward and "
                        "backward together)?", "collectives",
                        misconceptions=((2, "backward gathers the weights again: forward freed them"),
                                        (4, "the gradient needs one reduce-scatter, not an all-reduce "
                                         "plus a scatter"))),
        hint=FSDP_HINTS[0],
        hints=FSDP_HINTS[1:],
        show=("dplab.reference.zero.traffic.sent_closed_form",),
        try_this="dplab lesson check 10 ex   # judges ex/zero2_step.py and ex/fsdp_unit.py",
        exercise="fsdp_unit",
        teaches=("memory",),
    ),
    Step(
        title="Clipping by the global norm, when each rank holds a shard",
        text=("Recipes clip the gradient before the optimizer steps: "
              "torch.nn.utils.clip_grad_norm_ scales the WHOLE gradient g by min(1, max_norm / "
              "‖g‖). Under ZeRO-2/3 and FSDP no rank holds g: after the reduce-scatters rank r "
              "holds its chunk g_r of every layer's sum. Here {p} ranks, a step of this lesson's "
              "model: the shards' norms are {shards}; the whole gradient's is **{norm:.4f}** (one "
              "device), and max_norm is {max_norm:g}.\n\nThe chunks are disjoint, so the squares "
              "add and the norms do not: ‖g‖² = Σ_r ‖g_r‖². Each rank all-reduces ONE number, its "
              "shard's squared norm ({norm_bytes} bytes sent per rank, against {grad_bytes:,} for "
              "rank 0's reduce-scatters), takes the square root, and every rank gets {total:.4f}, "
              "the same on every rank ({same_everywhere}); each scales its chunks by {coef:.4f}, "
              "and they differ from the one-device clip by {diff:diff}.\n\nThe common bug clips "
              "each shard by its own norm: the ranks would scale by {wrong}, different "
              "coefficients on different chunks. Each shard's norm is about 1/√{p} of the whole's, "
              "so each rank clips too little: the \"clipped\" gradient's norm would be "
              "**{bug_norm:.2f}**, not {max_norm:g}, and it would turn {angle:.1f}° away from the "
              "gradient's direction (cosine {cos:.4f}); on another world size, another step. "
              "Adding the norms instead (Σ ‖g_r‖ = {sum_norms:.4f}) overstates ‖g‖ and clips too "
              "hard. torch's FSDP.clip_grad_norm_ does the same: each rank's shard norm squared, "
              "one all-reduce (a sum), then the square root; dplab's FSDP wrapper "
              "(backends/nn/fsdp.py) gathers one norm per rank and takes their norm, the same "
              "number."),
        run=clipping_a_shard,
        checks=(Check("the all-reduced squares give the one-device norm, on every rank",
                      lambda f: abs(f["total"] - f["norm"]) <= 1e-12 * f["norm"]
                      and f["same_everywhere"]),
                Check("the clipped chunks are the one-device clip's (to 1e-12)",
                      lambda f: f["diff"] <= 1e-12),
                Check("this gradient is clipped: its norm is above max_norm",
                      lambda f: f["coef"] < 1),
                Check("clipping by each shard's own norm scales the ranks differently and turns "
                      "the "
                      "gradient",
                      lambda f: len(set(f["wrong_list"])) == f["p"] and f["cos"] < 0.9999),
                Check("each shard's norm is within 25% of ‖g‖/√p",
                      lambda f: all(abs(n * f["p"] ** 0.5 / f["norm"] - 1) < 0.25
                                    for n in f["own"])),
                Check("clipped by each shard's own norm, the gradient stays over 1.5x max_norm",
                      lambda f: f["bug_norm"] > 1.5 * f["max_norm"]),
                Check("the sum of the shards' norms overstates the norm",
                      lambda f: f["sum_norms"] > 1.2 * f["norm"])),
        predict=Predict("{p} ranks hold disjoint shards of the gradient, whose norms are {shards}. "
                        "What is "
                        "the norm of the whole gradient?", "norm", rel_tol=2e-3,
                        misconceptions=(
                            (lambda g, f: abs(g - f["sum_norms"]) < 2e-3 * f["sum_norms"],
                             "that adds the norms; norms of disjoint pieces do not add, their "
                             "squares do: ‖g‖ = √(Σ ‖g_r‖²)"),
                            (lambda g, f: abs(g - f["norm"] ** 2) < 2e-3 * f["norm"] ** 2,
                             "that is ‖g‖², the sum of the squares: take its square root"),
                            (lambda g, f: abs(g - f["norm"] / f["p"] ** 0.5) < 2e-3 * f["norm"],
                             "that averages the squares; the whole gradient's is their sum"))),
        hint="The shards are disjoint pieces of one vector: what adds up across them, the norms or "
             "the squares?",
        show=("dplab.reference.zero.clip.clip_grad_norm",),
        try_this="python -c \"import dplab.reference.zero.clip as c; help(c)\"",
        teaches=("memory", "grad-clipping"),
    ),
    Step(
        title="Exercise: clip a sharded gradient by its global norm",
        text=("Now write it. In DIR/sharded_clip.py, `sharded_clip(comm, backward, shard, "
              "max_norm)` already reduce-scatters each layer as backward yields it and keeps this "
              "rank's chunk in `shard[layer]` (the ZeRO-2 loop); clip those chunks so that the "
              "whole gradient's norm is at most max_norm, and return that norm. `dplab lesson "
              "check 10 DIR` runs it on {first} to {last} ranks, once with max_norm {low:g} times "
              "the norm and once at {high:g} times it, and holds every chunk and the norm you "
              "return to torch.nn.utils.clip_grad_norm_ on one device with the whole gradient. It "
              "names the usual wrong turns: each shard clipped by its own norm, the norms "
              "all-reduced instead of their squares, the square root forgotten, the squares "
              "averaged instead of summed, clipping before every reduce-scatter has completed, a "
              "coefficient above 1, and moving the whole gradient to take its norm. The stub clips "
              "each shard by its own norm; checked as shipped it says:\n\n> {stub_says}"),
        run=clip_exercise,
        checks=(Check("the stub fails its check, naming its own shard's norm",
                      lambda f: not f["stub_passed"] and "its own shard" in f["stub_says"]),),
        hint=CLIP_HINTS[0],
        hints=CLIP_HINTS[1:],
        show=("dplab.lessons.exercises.stubs.sharded_clip.sharded_clip",),
        try_this="dplab lesson check 10 ex   # zero2_step.py, fsdp_unit.py and sharded_clip.py",
        exercise="sharded_clip",
        teaches=("grad-clipping",),
    ),
)

LESSON = Lesson(10, "memory", "Memory: replicas vs ZeRO-1/2/3 and FSDP; when data parallelism is not enough",
                "What each rank must hold, what sharding it costs in bytes, and when to split the model.",
                STEPS)
