"""Lesson 5: Amdahl's law and the communication-to-computation ratio, measured.

    dplab lesson 5

Four steps: Amdahl's law on paper; strong scaling measured here for a small and a larger model
at 1, 2 and 4 ranks; where each step's time goes (compute, exposed communication, waiting, the
rest), from the trace; and Amdahl's bound from the serial fraction the trace measured.
"""

from __future__ import annotations

from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.trace_metrics import step_split
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]

# the same global batch on every world size (strong scaling); the large model computes ~500x more per step
MODELS = {"small": TrainConfig(global_batch=32, steps=6),
          "large": TrainConfig(model=MLPConfig(in_dim=16, hidden=(256, 256), out_dim=4), num_samples=512,
                               global_batch=256, steps=4)}
WORLD_SIZES = (1, 2, 4)
REPS = 5  # world sizes and models interleaved; each cell the fastest (least disturbed) repetition


def amdahl(serial, p):
    """The best speedup on p ranks when a share ``serial`` of the
    one-rank time cannot be split."""
    return 1 / (serial + (1 - serial) / p)


def amdahl_on_paper(lab):
    f = 0.1
    return {"f_pct": 100 * f,
            "s2": amdahl(f, 2),
            "s4": amdahl(f, 4),
            "s64": amdahl(f, 64),
            "ceiling": 1 / f,
            "grows": [amdahl(f, p) for p in (1, 2, 4, 8, 64)]}


def timed_training(comm, cfg):
    comm.tracer.enabled = True
    train_sync(comm, cfg, SyncConfig("ring"))
    comm.tracer.enabled = False
    events = comm.tracer.take()
    # step 0 is warm-up
    return step_split(events, first_step=1), events


def measure_scaling(lab):
    """Every (model, world size) cell, interleaved, REPS times; the
    slowest rank's mean step, the fastest repetition (kept for
    the lesson's later steps: measuring is the slow part)."""
    if "l05" not in lab.scratch:
        step_ms, splits, traces = {}, {}, {}
        for _ in range(REPS):
            for p in WORLD_SIZES:
                for name, cfg in MODELS.items():
                    ranks = lab.world(p).run(timed_training, cfg)
                    split0 = ranks[0][0]
                    slowest = max(r[0].step_ms for r in ranks)
                    step_ms.setdefault((name, p), []).append(slowest)
                    splits.setdefault((name, p), []).append(split0)
                    traces[name, p] = [r[1] for r in ranks]
        # the least disturbed repetition: a busy machine only adds time
        fastest = {k: min(v) for k, v in step_ms.items()}
        lab.scratch["l05"] = (fastest, splits, traces)
    return lab.scratch["l05"]


def strong_scaling(lab):
    step_ms, _, _ = measure_scaling(lab)
    eff = {(m, p): step_ms[m, 1] / (p * step_ms[m, p])
           for m in MODELS for p in WORLD_SIZES}

    def row(m):
        params = MLP(MODELS[m].model).num_params
        cells = [f"{step_ms[m, p]:.2f} ms, E={eff[m, p]:.2f}"
                 for p in WORLD_SIZES]
        return f"| {m} ({params:,} params) | " + " | ".join(cells) + " |"

    return {"table": "\n".join(row(m) for m in MODELS),
            "eff": eff,
            "batch_small": MODELS["small"].global_batch,
            "batch_large": MODELS["large"].global_batch,
            "ratio2": eff["large", 2] / eff["small", 2],
            "ratio4": eff["large", 4] / eff["small", 4],
            "better": max(MODELS, key=lambda m: eff[m, 2] + eff[m, 4])}


def where_time_goes(lab):
    _, splits, traces = measure_scaling(lab)
    out = {"traces": traces["small", 2]}
    for m in MODELS:
        # the least disturbed repetition
        s = min(splits[m, 2], key=lambda x: x.step_ms)
        parts = (s.compute_ms + s.exposed_comm_ms + s.waiting_ms
                 + s.other_ms)
        out[m] = {"step": s.step_ms,
                  "compute": s.compute_ms,
                  "comm": s.exposed_comm_ms,
                  "wait": s.waiting_ms,
                  "other": s.other_ms,
                  "ratio": (s.exposed_comm_ms + s.waiting_ms) / s.compute_ms,
                  "adds_up": abs(parts - s.step_ms) < 1e-6}

    def row(m):
        o = out[m]
        return (f"| {m} | {o['step']:.2f} | {o['compute']:.2f} "
                f"| {o['comm']:.2f} | {o['wait']:.2f} | {o['other']:.2f} "
                f"| {o['ratio']:.2g} |")

    out["table"] = "\n".join(row(m) for m in MODELS)
    return out


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    return timeline_figure([e for rank in facts["traces"] for e in rank], title="the small model on 2 ranks")


def amdahl_measured(lab):
    _, splits, _ = measure_scaling(lab)
    out = {}
    for m in MODELS:
        s = min(splits[m, 2], key=lambda x: x.step_ms)
        # what did not shrink: exposed comm, waits, Python
        serial = s.step_ms - s.compute_ms
        # its share of the work as one rank would do it
        f = serial / (serial + 2 * s.compute_ms)
        out[m] = {"f": f, "f_pct": 100 * f,
                  "ceiling": 1 / f,
                  "bound4": amdahl(f, 4)}
    return out


STEPS = (
    Step(
        title="Amdahl's law",
        text=("If a share f of one rank's time cannot be split, p ranks can at best run "
              "1 / (f + (1-f)/p) times faster. With f = {f_pct:g}%: {s2:.2f}x on 2 ranks, {s4:.2f}x on 4, "
              "{s64:.1f}x on 64, and never more than 1/f = {ceiling:g}x however many. In data parallelism "
              "the share that does not shrink is the communication (an all-reduce of the whole gradient on "
              "every rank, whatever p) and the per-step work every rank repeats."),
        run=amdahl_on_paper,
        checks=(Check("more ranks never hurt on paper", lambda f: f["grows"] == sorted(f["grows"])),
                Check("and never pass 1/f", lambda f: max(f["grows"]) < f["ceiling"])),
        predict=Predict("If {f_pct:g}% of a step cannot be parallelised, what is the best speedup on 4 "
                        "ranks?",
                        "s4", rel_tol=0.02, unit="x"),
        hint="1 / (0.1 + 0.9/4).",
        try_this="Change f to 1% and to 50% in amdahl_on_paper and compare the 64-rank speedups.",
        teaches=("amdahl",),
    ),
    Step(
        title="Strong scaling, measured: a small and a larger model",
        text=("The same global batch ({batch_small} for the small model, {batch_large} for the large) on "
              "1, 2 and 4 local ranks; each cell is the slowest rank's mean step, the fastest of interleaved "
              "repetitions, and E = T1 / (p Tp) the efficiency:\n\n"
              "| model | p=1 | p=2 | p=4 |\n|---|---|---|---|\n{table}\n\n"
              "The larger model keeps {ratio2:.1f}x the small one's efficiency at p=2 and {ratio4:.1f}x at "
              "p=4: it computes far more per byte it all-reduces, while the small model's step is almost all "
              "communication and per-step overhead, which more ranks cannot shrink. (This machine has two "
              "busy cores: four ranks share them, so no model scales to 4 here; on a loaded machine a "
              "single run can even look superlinear. The claim is the ratio.)"),
        run=strong_scaling,
        checks=(Check("the larger model scales better at p=2 (efficiency > 1.5x the small one's)",
                      lambda f: f["ratio2"] > 1.5),
                Check("and at p=4", lambda f: f["ratio4"] > 1.5)),
        predict=Predict("Which scales better from 1 to 4 ranks on the same global batch: 'small' or 'large'?",
                        "better", choices=("small", "large")),
        hint="Compute grows with parameters × batch, the all-reduce only with parameters.",
        try_this="dplab scaling --help   # the same split for any model and world size",
        explore=Explore("runs", lambda f: {"world_size": 2, "hidden": 256}),
        teaches=("amdahl",),
    ),
    Step(
        title="Where the time goes: compute, exposed communication, waiting",
        text=("The trace of rank 0 at p=2 splits a step (ms) into disjoint parts that add up: compute, "
              "communication with no compute under it, waiting for the last bucket, and the rest (Python "
              "between phases):\n\n"
              "| model | step | compute | exposed comm. | waiting | other | (comm + wait) / compute |\n"
              "|---|---|---|---|---|---|---|\n{table}\n\n"
              "The communication-to-computation ratio is the whole story of the step before: a small model "
              "spends more time talking than computing."),
        run=where_time_goes,
        checks=(Check("the parts add up to the step",
                      lambda f: f["small"]["adds_up"] and f["large"]["adds_up"]),
                Check("the small model's comm/compute ratio is larger than the large one's",
                      lambda f: f["small"]["ratio"] > f["large"]["ratio"])),
        figure=_timeline,
        hint="Exposed communication is comm time minus the compute that overlapped it.",
        try_this="dplab train --world-size 2 --trace run.json   # the Runs page shows the same split",
        explore=Explore("runs", lambda f: {"world_size": 2, "hidden": 16}),
        teaches=("amdahl",),
    ),
    Step(
        title="Amdahl's bound from the measured serial fraction",
        text=("Take what did not shrink at p=2 (step minus compute) as the serial part, and the "
              "compute of both ranks as the parallel part: the small model is **{small[f_pct]:.0f}%** "
              "serial, the large one **{large[f_pct]:.0f}%**. Amdahl then caps the small model at "
              "{small[ceiling]:.2g}x however many ranks, the large one at {large[ceiling]:.2g}x; at 4 ranks "
              "the bounds are {small[bound4]:.2f}x and {large[bound4]:.2f}x: a bound on the code, not on "
              "this machine, whose two cores four ranks share. To scale, make the serial part small: "
              "bigger per-rank work, fewer and larger all-reduces, overlap (lesson 4)."),
        run=amdahl_measured,
        checks=(Check("the small model has the larger serial fraction",
                      lambda f: f["small"]["f"] > f["large"]["f"]),
                Check("so its Amdahl ceiling is lower",
                      lambda f: f["small"]["ceiling"] < f["large"]["ceiling"])),
        hint="f = serial / (serial + parallel); ceiling = 1/f.",
        try_this="Raise the large model's global batch to 1024 in MODELS and watch its serial share fall.",
        teaches=("amdahl",),
    ),
)


LESSON = Lesson(5, "scaling", "Amdahl's law and the communication-to-computation ratio",
                "Why a larger model scales better, measured, and the ceiling Amdahl's law puts on it.", STEPS)
