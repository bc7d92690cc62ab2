"""Lesson 4: buckets, overlap with backward, and gradient accumulation.

    dplab lesson 4

Four steps: how DDP groups gradients into buckets (and the exercise that asks you to); a real
run's trace showing the first bucket's all-reduce running while backward still computes, and
the same overlap on a simulated DGX H100 node at three bucket caps; how
many all-reduces a step makes as ``bucket_cap_mb`` changes; and gradient accumulation, which
reduces once per step however many micro-batches it takes, and still equals one device.
"""

from __future__ import annotations

from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.trace_metrics import COMM_KINDS, COMPUTE_KINDS, intersect, measure
from dplab.reference.train.buckets import assign_buckets
from dplab.reference.train.single import TrainConfig, train_single
from dplab.viz.cost import format_bytes

__all__ = ["LESSON"]

# a wide middle layer: its backward is long enough to hide the last layer's all-reduce under it
MODEL = MLPConfig(in_dim=16, hidden=(512, 512), out_dim=4)
CAPS = (0.01, 0.1, 25.0)  # bucket_cap_mb: one bucket per layer, two, one for everything
R = "dplab.reference.train.buckets"  # the reducer: the spine code the steps show


def one_device(comm, cfg):
    # the oracle, run on a rank (one BLAS thread)
    return train_single(cfg).params


def buckets_of_the_model(lab):
    model = MLP(MODEL)
    names = model.param_names
    # float64: 8 bytes an element
    buckets = {cap: assign_buckets(model.param_slices, 8, cap)
               for cap in CAPS}

    def row(cap):
        cells = [",".join(names[i] for i in b) for b in buckets[cap]]
        return f"| {cap:g} | " + " ; ".join(cells) + " |"

    nbytes = [(s.stop - s.start) * 8 for s in model.param_slices]
    small = buckets[CAPS[0]]
    every = [b for bs in buckets.values() for b in bs]
    # each bucket but the last holds at least its cap
    full = all(sum(nbytes[i] for i in b) >= cap * 2**20
               for cap in CAPS for b in buckets[cap][:-1])
    last = len(names) - 1
    return {"table": "\n".join(row(cap) for cap in CAPS),
            "cap": CAPS[0],
            "count": len(small),
            "counts": [len(buckets[c]) for c in CAPS],
            "reverse": all(bs[0][0] == last for bs in buckets.values()),
            "contiguous": all(b == list(range(b[0], b[-1] - 1, -1))
                              for b in every),
            "full": full,
            "sizes": ", ".join(f"{n} {format_bytes(b)}"
                               for n, b in zip(names, nbytes))}


def overlap_in_the_trace(lab):
    cfg = TrainConfig(model=MODEL, num_samples=256,
                      global_batch=128, steps=6)
    single = lab.world(1).run(one_device, cfg)[0]
    spec = RunSpec(world_size=2, bucket_cap_mb=CAPS[0], train=cfg)
    row, events = run_train(spec, world=lab.world(2), trace=True,
                            single=single)
    rank0 = events[0]
    starts = [e.t_start_ns for e in rank0
              if e.kind == "bucket" and e.extra["bucket"] == 0]
    # per step: does the first bucket start before backward ends?
    early = []
    for step in range(cfg.steps):
        mine = [e for e in rank0 if e.extra.get("step") == step]
        begin = min(e.t_start_ns for e in mine)
        backward_end = max(e.t_end_ns for e in mine
                           if e.kind == "backward")
        first = min(t for t in starts if t > begin)
        early.append(first < backward_end)
    comm = [(e.t_start_ns, e.t_end_ns) for e in rank0
            if e.kind in COMM_KINDS]
    compute = [(e.t_start_ns, e.t_end_ns) for e in rank0
               if e.kind in COMPUTE_KINDS]
    hidden = measure(intersect(comm, compute)) / measure(comm)
    return _dgx_facts() | {"steps": cfg.steps, "events": events,
            "early": sum(early),
            "hidden_pct": 100 * hidden,
            "diff": row["max_abs_diff_vs_single"],
            "identical": row["ranks_identical"]}


DGX = "dgx-h100"           # one simulated DGX H100 node: 8 GPUs on NVLink
DGX_CAPS = (10_000.0, 25.0, 5.0)  # bucket_cap_mb: one bucket for everything, DDP's default, small
DGX_SAMPLES = 4            # samples of SIM_TOKENS tokens per GPU (lesson 5's)


def overlap_on_a_dgx():
    """A DDP step of lesson 5's transformer on 8 simulated H100s at
    three bucket caps: (step, compute, the all-reduce alone), seconds."""
    from dplab.backends.sim.timing import collective_time, ddp_step_time
    from dplab.lessons.l05_scaling import sim_layers
    layers = sim_layers(DGX_SAMPLES, DGX)
    compute = sum(f + b for _, f, b in layers)
    grads = 2 * sum(n for n, _, _ in layers)       # bfloat16
    alone = collective_time(DGX, 8, "ring", grads, 2).seconds
    steps = {cap: ddp_step_time(DGX, 8, layers, cap, "ring", 2).seconds
             for cap in DGX_CAPS}
    return steps, compute, alone, grads, sum(b for _, _, b in layers)


def _dgx_facts():
    from dplab.lessons.l05_scaling import SIM_BLOCKS, SIM_TOKENS, SIM_WIDTH
    steps, compute, alone, grads, backward = overlap_on_a_dgx()
    one, default, small = (steps[c] for c in DGX_CAPS)
    exposed = {c: steps[c] - compute for c in DGX_CAPS}
    rows = "\n".join(f"| {'one bucket' if c == DGX_CAPS[0] else f'{c:g} MiB'} | "
                      f"{steps[c] * 1e3:.3f} | {exposed[c] * 1e3:.3f} | "
                      f"{max(0.0, 100 * (1 - exposed[c] / alone)):.0f}% |" for c in DGX_CAPS)
    return {"dgx_rows": rows, "dgx_grads": grads, "dgx_alone_ms": alone * 1e3,
            "dgx_compute_ms": compute * 1e3, "dgx_backward_ms": backward * 1e3,
            "dgx_samples": DGX_SAMPLES, "dgx_exposed": [exposed[c] for c in DGX_CAPS],
            "dgx_blocks": SIM_BLOCKS, "dgx_width": SIM_WIDTH, "dgx_tokens": SIM_TOKENS,
            "dgx_params": grads // 2,
            "dgx_alone": alone, "dgx_saved_pct": 100 * (1 - default / one)}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    events = [e for rank in facts["events"] for e in rank]
    return timeline_figure(events, title="2 ranks: buckets under backward")


def _bucket_lanes(facts):
    """Rank 0's last step in the terminal: backward on one lane, the buckets' all-reduces on the next
    (bucket events carry no step: they are taken by time, from the step's first event on)."""
    from dplab.lessons.pictures_terminal import bucket_timeline
    events = facts["events"][0]
    begin = min(e.t_start_ns for e in events if e.extra.get("step") == facts["steps"] - 1)
    return bucket_timeline([e for e in events if e.t_start_ns >= begin])


def count_allreduces(lab):
    cfg = TrainConfig(model=MODEL, num_samples=256,
                      global_batch=128, steps=2)
    single = lab.world(1).run(one_device, cfg)[0]
    model = MLP(MODEL)
    out = {"caps": list(CAPS), "params": model.num_params}
    for cap in CAPS:
        spec = RunSpec(world_size=2, bucket_cap_mb=cap, train=cfg)
        row, events = run_train(spec, world=lab.world(2), trace=True,
                                single=single)
        buckets = [e for e in events[0] if e.kind == "bucket"]
        planned = assign_buckets(model.param_slices, 8, cap)
        out[cap] = {
            "per_step": len(buckets) // cfg.steps,
            "bytes_per_step": sum(e.bytes for e in buckets) // cfg.steps,
            "planned": len(planned),
            "diff": row["max_abs_diff_vs_single"]}
    out["per_step"] = ", ".join(str(out[c]["per_step"]) for c in CAPS)
    out["caps_text"] = ", ".join(f"{c:g}" for c in CAPS)
    out["one_bucket"] = out[CAPS[-1]]["per_step"]
    out["big"] = CAPS[-1]
    return out


def accumulate(lab):
    cfg = TrainConfig(model=MODEL, num_samples=256,
                      global_batch=128, steps=3)
    single = lab.world(1).run(one_device, cfg)[0]
    out = {"steps": cfg.steps}
    for k in (1, 4):
        spec = RunSpec(world_size=2, bucket_cap_mb=CAPS[-1],
                       accum_steps=k, train=cfg)
        row, events = run_train(spec, world=lab.world(2), trace=True,
                                single=single)
        kinds = [e.kind for e in events[0]]
        out[k] = {"forwards": kinds.count("forward") / cfg.steps,
                  "allreduces": kinds.count("bucket") / cfg.steps,
                  "diff": row["max_abs_diff_vs_single"]}
    out["micro"] = out[4]["forwards"]
    out["allreduces_4"] = int(out[4]["allreduces"])
    out["diff4"] = out[4]["diff"]
    return out


STEPS = (
    Step(
        title="Buckets: gradients grouped in the order backward makes them",
        text=("Backward produces gradients last layer first. DDP does not all-reduce each parameter "
              "alone (one latency each) nor all of them at the end (the network idle during backward): it "
              "walks the parameters in reverse and closes a bucket once it holds at least `bucket_cap_mb` "
              "(in MiB, as torch reads it: the cap × 1024 × 1024 bytes). A parameter is never split. This "
              "model's parameters (float64): {sizes}.\n\n"
              "| bucket_cap_mb | buckets, in launch order |\n|---|---|\n{table}\n\n"
              "Each bucket is a contiguous slice of one flat gradient buffer, so it is all-reduced in place. "
              "Your turn: `dplab lesson init DIR` copies the stubs, write the bucket assignment in "
              "`ddp_buckets.py`, and `dplab lesson check 4 DIR` compares it with the engine's on random "
              "models, then trains with your buckets against one device."),
        run=buckets_of_the_model,
        checks=(Check("the first bucket starts with the last parameter", lambda f: f["reverse"]),
                Check("every bucket is a contiguous run of parameters, in reverse",
                      lambda f: f["contiguous"]),
                Check("every bucket but the last holds at least the cap", lambda f: f["full"]),
                Check("a larger cap never makes more buckets ({counts})",
                      lambda f: f["counts"] == sorted(f["counts"], reverse=True) and f["counts"][-1] == 1)),
        predict=Predict("With bucket_cap_mb={cap:g} (10.24 KiB), how many buckets does this model get?",
                        "count", misconceptions=(
                            (6, "one bucket per parameter would need a cap below the smallest one; a bias "
                                "of a few KiB stays in the bucket until the cap is reached"),
                            (1, "one bucket for everything is what a large cap (25) gives"))),
        hint="Walk the parameters from the last (b2) backwards and add up their sizes.",
        hints=("A bucket closes as soon as what it holds reaches the cap; the next parameter opens a new "
               "one.",),
        # the exercise's stub: the engine's assign_buckets is its answer (shown in step 3, after it)
        show=("dplab.lessons.exercises.stubs.ddp_buckets.ddp_buckets",),
        inputs={"cap": CAPS[0]},
        try_this="dplab lesson init ex && dplab lesson check 4 ex   # then fill in ex/ddp_buckets.py",
        exercise="ddp_buckets",
        teaches=("buckets",),
    ),
    Step(
        title="Overlap: the first bucket is reduced while backward still runs",
        text=("Two ranks train {steps} steps with one bucket per layer, the trace on. In "
              "**{early} of {steps}** steps, rank 0's first bucket (the last layer's gradients) started its "
              "all-reduce before "
              "backward had finished: the communication thread reduces it while the main thread computes "
              "the wide middle layer's gradients. In this run {hidden_pct:.0f}% of rank 0's communication "
              "time ran under compute; that share is one measurement on a shared machine and moves from run "
              "to run, so the step claims only that some of it did. Overlap changes when things happen, not "
              "what is computed: the replicas are identical ({identical}) and within {diff:.1e} of one "
              "device.\n\n"
              "That was this machine: two ranks on two shared cores, where a rank's comm thread takes "
              "the core its backward needs, so how much hides is the scheduler's call. **On a simulated "
              "DGX H100 node** (8 GPUs on NVLink; simulated time, the same at any load), a transformer's "
              "matmuls ({dgx_blocks} blocks of 12 d² weights at d = {dgx_width}: {dgx_params:,} "
              "parameters, the model lesson 5 scales to 64 GPUs) train with DDP, {dgx_samples} samples "
              "of {dgx_tokens:,} tokens per GPU: backward "
              "takes {dgx_backward_ms:.3f} ms, and the ring all-reduce of its {dgx_grads:size} of "
              "bfloat16 gradients takes {dgx_alone_ms:.3f} ms on its own. A step (compute "
              "{dgx_compute_ms:.3f} ms) at three bucket caps, in ms:\n\n"
              "| buckets | step | exposed all-reduce | hidden |\n|---|---|---|---|\n{dgx_rows}\n\n"
              "One bucket waits for the whole backward and hides nothing. DDP's 25 MiB buckets start "
              "reducing while backward goes on and cut the step by {dgx_saved_pct:.0f}%; smaller ones "
              "hide more, down to the last bucket, whose gradients are ready only as backward ends."),
        run=overlap_in_the_trace,
        checks=(Check("simulated: one bucket hides nothing (its whole all-reduce is exposed)",
                      lambda f: abs(f["dgx_exposed"][0] - f["dgx_alone"]) < 1e-9),
                Check("simulated: smaller buckets expose less, and the last bucket stays exposed",
                      lambda f: f["dgx_exposed"][0] > f["dgx_exposed"][1] > f["dgx_exposed"][2] > 0),
                Check("the trace shows a bucket's all-reduce starting before backward ended",
                      lambda f: f["early"] >= 1),
                Check("some communication ran under compute (> 0%)", lambda f: f["hidden_pct"] > 0),
                Check("and the result is one device's, to rounding (< 1e-12)",
                      lambda f: f["identical"] and f["diff"] < 1e-12)),
        figure=_timeline,
        picture=_bucket_lanes,
        hint="In the figure, look for a bucket bar on the comm lane under a backward bar on the main lane.",
        show=(f"{R}.Reducer.mark_param_as_ready", f"{R}.Reducer._comm_loop"),
        try_this="dplab train --world-size 2 --bucket-cap-mb 0.01 --trace run.json   # open it in the app",
        explore=Explore("runs", lambda f: {"world_size": 2, "bucket_mb": 0.01, "hidden": 512,
                                           "steps": f["steps"]}),
        teaches=("buckets",),
    ),
    Step(
        title="Bucket count against bucket_cap_mb",
        text=("The same run with bucket_cap_mb = {caps_text}: the trace counts {per_step} all-reduces per "
              "step, exactly the buckets planned, and together they carry every gradient every step. Small "
              "buckets start early (more overlap) but each pays a latency; one big bucket ({one_bucket:g} "
              "all-reduce a step) pays one latency and overlaps nothing. torch DDP's default is "
              "bucket_cap_mb=25, which it reads as 25 MiB, with the first bucket capped at 1 MiB so that "
              "something starts early."),
        run=count_allreduces,
        checks=(Check("the trace's all-reduces per step equal the planned buckets",
                      lambda f: all(f[c]["per_step"] == f[c]["planned"] for c in f["caps"])),
                Check("they carry all the gradient bytes, every step",
                      lambda f: all(f[c]["bytes_per_step"] == 8 * f["params"] for c in f["caps"])),
                Check("every bucketing trains like one device (< 1e-12)",
                      lambda f: all(f[c]["diff"] < 1e-12 for c in f["caps"]))),
        predict=Predict("bucket_cap_mb={big:g} holds all of this model's float64 gradients in one bucket. "
                        "How many all-reduces does a rank run per step?", "one_bucket", misconceptions=(
                            (6, "six is one per parameter; a bucket holds as many as fit under its cap"),)),
        hint="Bucketing changes how the sum is cut, not the sum: the result is the same bits on every rank.",
        show=(f"{R}.assign_buckets",),
        inputs={"big": CAPS[-1]},
        try_this="dplab train --world-size 4 --bucket-cap-mb 0.002 --trace run.json   # many small buckets",
        explore=Explore("runs", lambda f: {"world_size": 2, "bucket_mb": 25.0, "hidden": 512}),
        teaches=("buckets",),
    ),
    Step(
        title="Gradient accumulation: one all-reduce per step, not per micro-batch",
        text=("With accum_steps=4 each rank runs its shard as {micro:g} micro-batches per step: {micro:g} "
              "forward and backward passes add into the same gradient, and only the last one launches the "
              "all-reduce "
              "(the others run under `no_sync`). The trace counts {allreduces_4} all-reduce per step, as "
              "without accumulation. The result still equals one device ({diff4:.1e}): accumulation trades "
              "memory (a smaller micro-batch) for time, never the result."),
        run=accumulate,
        checks=(Check("four forward passes per step with accum_steps=4", lambda f: f[4]["forwards"] == 4),
                Check("one all-reduce per step, with or without accumulation",
                      lambda f: f[4]["allreduces"] == f[1]["allreduces"] == 1),
                Check("both equal one device (< 1e-12)", lambda f: max(f[1]["diff"], f[4]["diff"]) < 1e-12)),
        predict=Predict("accum_steps=4 and one bucket: how many all-reduces does a rank run per step?",
                        "allreduces_4", misconceptions=(
                            (4, "one per micro-batch is what no_sync avoids: the first three only add into "
                                "the gradient"),)),
        hint="Is anything gained by summing across ranks before the last micro-batch has added its part?",
        hints=("no_sync() turns mark_param_as_ready into a no-op for all but the last micro-batch.",),
        show=(f"{R}.Reducer.no_sync", f"{R}.Reducer.mark_param_as_ready"),
        try_this="dplab train --world-size 2 --accum-steps 4   # still within rounding of one device",
        teaches=("accumulation",),
    ),
)


LESSON = Lesson(4, "buckets", "Buckets, overlap with backward, gradient accumulation",
                "How DDP hides the all-reduce behind backward, and how accumulation keeps it to one a step.",
                STEPS)
