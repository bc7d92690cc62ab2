"""Lesson 5: how a step's time splits as ranks are added, strong and weak scaling, and what to trust.

    dplab lesson 5

Four steps. The model T(p) = T_comp/p + T_comm(p) on the cost model: communication is zero on
one rank and grows with p, so the speedup peaks and falls (Amdahl's law, whose serial part never
grows, cannot say that). Strong vs weak scaling: compute per byte sent is set by the samples
each rank computes on, not by the model's size (Gustafson's answer to Amdahl). Strong and weak
scaling of a DDP step on 64 simulated H100s (dgx-h100x8), beside where the time goes on this
machine, measured with its spread. And why a serial share measured here belongs to this machine,
not to the code.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAYS
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.costmodel import cost
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.topology import PRESETS
from dplab.reference.trace_metrics import step_split
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON", "step_time", "flops_per_sample", "amdahl", "overlapped"]

SMALL = MLPConfig()                                            # 8 -> 16 -> 16 -> 4: 484 parameters
LARGE = MLPConfig(in_dim=16, hidden=(256, 256), out_dim=4)     # 71,172 parameters
FLOPS = 1e10        # an assumed device: 10 GFLOP/s (a CPU core); what matters is the ratio to the link
LINK = PRESETS["flat-10g"]                                     # 10 Gb/s Ethernet, 5 us a message
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPS = 5            # measured cells, interleaved; every repetition is shown, not just the best
SIM_CLUSTER = "dgx-h100x8"   # 8 DGX H100 nodes: 64 GPUs, NVLink inside a node, InfiniBand between
SIM_PS = (1, 2, 4, 8, 16, 32, 64)
SIM_BLOCKS, SIM_WIDTH, SIM_TOKENS = 8, 512, 1024  # a transformer's matmuls: 8 blocks of 12 d² weights
SIM_PER_GPU = 4     # weak scaling's samples per GPU; strong scaling's global batch is 64 times that
SIM_ALGORITHM = "hierarchical:8"  # lesson 2's two-level all-reduce: NVLink, then every GPU's NIC


def _bars(rows, unit="", width=40, title=""):
    """A terminal picture: one bar per (label, value), on one scale."""
    from rich.text import Text
    top = max(v for _, v in rows) or 1
    text = Text(f"{title}\n" if title else "")
    for label, value in rows:
        text.append(f"{label:>10} ")
        text.append("█" * max(1, round(width * value / top)), style="cyan")
        text.append(f" {value:.3g}{unit}\n")
    return text


def flops_per_sample(model):
    """Forward 2 FLOPs per weight per sample, backward 4: 6 in all."""
    cfg = model.cfg
    dims = (cfg.in_dim, *cfg.hidden, cfg.out_dim)
    return 6 * sum(a * b for a, b in zip(dims[:-1], dims[1:]))


def step_time(model, samples_per_rank, p, topology=LINK):
    """(compute, communication) seconds of one step on p ranks: the
    rank's share of the FLOPs, and a ring all-reduce of the float32
    gradient priced by the cost model (zero on one rank)."""
    compute = flops_per_sample(model) * samples_per_rank / FLOPS
    ring = ARRAYS["ring"](p)   # the ring's schedule, built as arrays
    comm = cost(ring, 4 * model.num_params, topology=topology).time
    return compute, comm


def resnet50_counts(size=224, classes=1000):
    """ResNet-50 (He et al. 2016, torchvision's v1.5) from its layer
    table: (parameters, forward multiply-adds per image)."""
    params, macs = 0, 0

    def conv(cin, cout, k, h):           # a k x k conv and its BatchNorm
        nonlocal params, macs
        params += k * k * cin * cout + 2 * cout
        macs += k * k * cin * cout * h * h   # every weight, every pixel

    h = size // 2
    conv(3, 64, 7, h)
    h //= 2                              # the max pool
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2),
                                (512, 3, 2)):
        for i in range(blocks):          # bottlenecks: 1x1, 3x3, 1x1
            conv(cin, mid, 1, h)
            h //= stride if i == 0 else 1
            conv(mid, mid, 3, h)
            conv(mid, 4 * mid, 1, h)
            if i == 0:                   # the shortcut's projection
                conv(cin, 4 * mid, 1, h)
            cin = 4 * mid
    params += cin * classes + classes    # the classifier
    macs += cin * classes
    return params, macs


def amdahl(serial, p):
    """Amdahl's best speedup when a share ``serial`` cannot be split."""
    return 1 / (serial + (1 - serial) / p)


def overlapped(compute, comm):
    """A step's time when backward (4 of the 6 FLOPs per weight) hides
    the all-reduce as lesson 4's buckets do, at best."""
    return compute / 3 + max(2 * compute / 3, comm)


def peak_and_fall(lab):
    model, batch = MLP(LARGE), 4096      # strong scaling: the batch is fixed
    t1 = sum(step_time(model, batch, 1))
    rows = {}
    for p in WORLD_SIZES:
        comp, comm = step_time(model, batch / p, p)
        rows[p] = (comp, comm, t1 / (comp + comm), t1 / overlapped(comp, comm))
    # Amdahl, fitted to p = 2: the share f that gives the same T(2)
    f = 2 * rows[2][1] / t1
    best = max(rows, key=lambda p: rows[p][2])
    best_ov = max(rows, key=lambda p: rows[p][3])
    table = "\n".join(f"| {p} | {c * 1e3:.3g} | {m * 1e3:.3g} | {s:.3g}x "
                      f"| {o:.3g}x | {amdahl(f, p):.3g}x |"
                      for p, (c, m, s, o) in rows.items())
    return {"batch": batch, "params": model.num_params, "table": table,
            "gflops": FLOPS / 1e9, "link": LINK.name,
            "comm_1": rows[1][1], "comms": [r[1] for r in rows.values()],
            "speedups": [r[2] for r in rows.values()],
            "amdahls": [amdahl(f, p) for p in WORLD_SIZES],
            "best_p": best, "best_s": rows[best][2],
            "last_p": WORLD_SIZES[-1], "last_s": rows[WORLD_SIZES[-1]][2],
            "f_pct": 100 * f, "amdahl_last": amdahl(f, WORLD_SIZES[-1]),
            "falls": "yes" if rows[best][2] > rows[WORLD_SIZES[-1]][2]
            else "no",
            "overlaps": [r[3] for r in rows.values()],
            "best_p_ov": best_ov, "best_ov": rows[best_ov][3],
            "last_ov": rows[WORLD_SIZES[-1]][3],
            "perfect_to": max(p for p, r in rows.items()
                              if r[1] <= 2 * r[0] / 3)}


def traced_bytes(comm, cfg):
    comm.tracer.enabled = True
    train_sync(comm, cfg, SyncConfig("ring"))
    comm.tracer.enabled = False
    return sum(e.bytes for e in comm.tracer.take() if e.kind == "send")


def per_step_bytes(lab, model_cfg, p):
    """Bytes rank 0 sends in one training step on the real engine:
    two steps minus one (the start's broadcast cancels)."""
    cfg = TrainConfig(model=model_cfg, global_batch=64, num_samples=256,
                      steps=1)
    world = lab.world(p)
    one = world.run(traced_bytes, cfg)[0]
    two = world.run(traced_bytes, replace(cfg, steps=2))[0]
    return two - one


def strong_and_weak(lab):
    per_rank = 16                   # weak scaling: each rank's samples fixed
    global_batch = 256              # strong scaling: the global batch fixed
    ps = (2, 4, 16, 64, 256)

    def flops_per_byte(model, samples, p):
        ring = ARRAYS["ring"](p)
        sent = cost(ring, 4 * model.num_params, 0, 0, 0).bytes_sent_max
        return flops_per_sample(model) * samples / sent

    small, large = MLP(SMALL), MLP(LARGE)
    strong = [flops_per_byte(large, global_batch / p, p) for p in ps]
    weak = [flops_per_byte(large, per_rank, p) for p in ps]
    same_b = {m: flops_per_byte(model, per_rank, 4)
              for m, model in (("small", small), ("large", large))}
    # the cost model's bytes are the engine's: one real step at p = 4
    engine = per_step_bytes(lab, LARGE, 4)
    model_bytes = cost(allreduce_schedule("ring", 4), 8 * large.num_params,
                       0, 0, 0, itemsize=8).bytes_sent_max
    # Gustafson: weak scaling's speedup, priced (p ranks do p times the work)
    one_rank = step_time(large, per_rank, 1)[0]
    gustafson = [p * one_rank / sum(step_time(large, per_rank, p))
                 for p in ps]
    table = "\n".join(f"| {p} | {global_batch / p:g} | {s:.3g} | {w:.3g} "
                      f"| {g:.3g}x |"
                      for p, s, w, g in zip(ps, strong, weak, gustafson))
    ratio = same_b["large"] / same_b["small"]
    # weak scaling's FLOPs per byte fall only by the ring's 2(p-1)/p: 1 at p = 2, nearly 2 at 256
    ring_factor = (2 * (ps[-1] - 1) / ps[-1]) / (2 * (ps[0] - 1) / ps[0])
    compute_last, comm_last = step_time(large, per_rank, ps[-1])
    about = "same" if 0.5 < ratio < 2 else "large" if ratio > 1 else "small"
    cnn_params, cnn_macs = resnet50_counts()
    return {"table": table, "per_rank": per_rank,
            "global_batch": global_batch, "ps": list(ps),
            "strong": strong, "weak": weak, "gustafson": gustafson,
            "small": same_b["small"], "large": same_b["large"],
            "model_ratio": ratio, "about": about,
            "params_ratio": large.num_params / small.num_params,
            "engine_bytes": engine, "model_bytes": model_bytes,
            "loss_bytes": engine - model_bytes,
            "weak_fall": weak[0] / weak[-1], "ring_factor": ring_factor,
            "p_last": ps[-1], "g_last": gustafson[-1],
            "g_eff": gustafson[-1] / ps[-1],
            "comm_share": comm_last / (compute_last + comm_last),
            "cnn_params": cnn_params, "cnn_gflops": 2 * cnn_macs / 1e9,
            "cnn_per_param": 2 * cnn_macs / cnn_params,
            "cnn_macs_per_param": cnn_macs / cnn_params,
            "mlp_per_param": flops_per_sample(large) / 3 / large.num_params}


def sim_layers(samples, cluster=SIM_CLUSTER):
    """(weights, forward s, backward s) per block for ``samples`` of
    SIM_TOKENS tokens: 2 and 4 FLOPs a weight a token, at the device's
    rated bfloat16 peak."""
    from dplab.reference.cluster import cluster as named
    peak = named(cluster).device.rate("bfloat16")
    weights, tokens = 12 * SIM_WIDTH ** 2, samples * SIM_TOKENS
    block = (weights, 2 * weights * tokens / peak,
             4 * weights * tokens / peak)
    return [block] * SIM_BLOCKS


@functools.lru_cache(maxsize=1)
def simulated_scaling():
    """A DDP step (bucketed, overlapping backward) on 1 to 64 simulated
    GPUs, simulated seconds: strong scaling (64 x SIM_PER_GPU samples in
    all) and weak scaling (SIM_PER_GPU per GPU). At p = 64 they are one
    run."""
    from dplab.backends.sim.timing import ddp_step_time

    def step(p, per_gpu):
        layers = sim_layers(per_gpu)
        return ddp_step_time(SIM_CLUSTER, p, layers, 25.0, SIM_ALGORITHM,
                             2).seconds, sum(f + b for _, f, b in layers)

    rows = {}
    for p in SIM_PS:
        strong = step(p, SIM_PS[-1] * SIM_PER_GPU / p)
        weak = strong if p == SIM_PS[-1] else step(p, SIM_PER_GPU)
        rows[p] = (strong, weak)
    return rows


def scaling_on_64_gpus():
    """Step 3's simulated half: speedups, efficiencies, exposed time."""
    from dplab.reference.cluster import cluster as named
    rows, c = simulated_scaling(), named(SIM_CLUSTER)
    (s1, _), (w1, _) = rows[1]
    eff_s = {p: s1 / (p * s) for p, ((s, _), _) in rows.items()}
    eff_w = {p: w1 / w for p, (_, (w, _)) in rows.items()}
    last = SIM_PS[-1]
    table = "\n".join(
        f"| {p} | {c.node_of(p - 1) + 1} | {last * SIM_PER_GPU / p:g} | "
        f"{s * 1e3:.3g} | {eff_s[p]:.2f} | {w * 1e3:.3g} | {eff_w[p]:.2f} |"
        for p, ((s, _), (w, _)) in rows.items())
    (s_last, comp_last), _ = rows[last]
    return {"sim_table": table, "sim_cluster": SIM_CLUSTER,
            "sim_gpus": c.size, "sim_per_node": c.ranks_per_node,
            "sim_device": c.device.name,
            "sim_params": 12 * SIM_WIDTH ** 2 * SIM_BLOCKS,
            "sim_blocks": SIM_BLOCKS, "sim_width": SIM_WIDTH,
            "sim_tokens": SIM_TOKENS, "sim_per_gpu": SIM_PER_GPU,
            "sim_global": last * SIM_PER_GPU, "sim_alg": SIM_ALGORITHM,
            "eff_strong": [eff_s[p] for p in SIM_PS],
            "eff_weak": [eff_w[p] for p in SIM_PS],
            "eff_strong_8": eff_s[8], "eff_weak_8": eff_w[8],
            "eff_last": eff_s[last], "sim_last": last,
            "speedup_last": s1 / s_last,
            "exposed_last_pct": 100 * (s_last - comp_last) / s_last,
            "weak_growth": rows[last][1][0] / w1}


def timed_training(comm, cfg):
    comm.tracer.enabled = True
    train_sync(comm, cfg, SyncConfig("ring"))
    comm.tracer.enabled = False
    events = comm.tracer.take()
    # step 0 is warm-up
    return step_split(events, first_step=1), events


MEASURED = LARGE
BATCHES = {"4 per rank": 8, "512 per rank": 1024}              # global batches at p = 2


def measure(lab):
    """Every cell REPS times, interleaved (a busy spell hits all cells
    alike); kept for step 4: measuring is the slow part."""
    if "l05" not in lab.scratch:
        cells = {}
        for _ in range(REPS):
            for name, batch in BATCHES.items():
                cfg = TrainConfig(model=MEASURED, global_batch=batch,
                                  num_samples=1024, steps=3)
                for p in (1, 2):
                    ranks = lab.world(p).run(timed_training, cfg)
                    splits = [split for split, _ in ranks]
                    cells.setdefault((name, p), []).append(splits)
                    # the last traces of each cell, for the figure
                    lab.scratch["l05_trace", name, p] = [e for _, e in ranks]
        lab.scratch["l05"] = cells
    return lab.scratch["l05"]


def where_time_goes(lab):
    cells = measure(lab)
    ratio, parts = {}, {}
    for name in BATCHES:
        runs = [ranks[0] for ranks in cells[name, 2]]
        ratio[name] = sorted((s.exposed_comm_ms + s.waiting_ms) / s.compute_ms
                             for s in runs)
        # the median run
        s = sorted(runs, key=lambda s: s.step_ms)[len(runs) // 2]
        parts[name] = (s.step_ms, s.compute_ms, s.exposed_comm_ms,
                       s.waiting_ms, s.other_ms)
    table = "\n".join(f"| {n} | " + " | ".join(f"{v:.2f}" for v in parts[n])
                      + f" | {ratio[n][0]:.2g} to {ratio[n][-1]:.2g} |"
                      for n in BATCHES)
    few, many = BATCHES
    # the same ratio priced: one all-reduce, 4 or 512 samples of compute
    priced = {}
    for n, batch in BATCHES.items():
        compute, comm = step_time(MLP(MEASURED), batch / 2, 2)
        priced[n] = comm / compute
    carries = ratio[few][0] > ratio[many][-1]
    return scaling_on_64_gpus() | {"table": table, "reps": REPS,
            "load": os.getloadavg()[0],
            "measured_params": MLP(MEASURED).num_params,
            "traces": lab.scratch["l05_trace", few, 2],
            "lo": ratio[few], "hi": ratio[many],
            "priced_few": priced[few], "priced_many": priced[many],
            "priced_x": priced[few] / priced[many], "carries": carries,
            "verdict": VERDICT[carries],
            "adds_up": all(abs(sum(v[1:]) - v[0]) < 1e-6
                           for v in parts.values())}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    events = [e for rank in facts["traces"] for e in rank]
    return timeline_figure(events, title="4 samples per rank, 2 ranks")


VERDICT = {True: "every repetition at 4 per rank is above every one at 512: here the spread is "
                 "smaller than the effect, and the measurement carries the claim",
           False: "the two ranges overlap: on these shared cores the spread is as large as the "
                  "effect, so this measurement cannot carry the claim; the priced ratio does"}


def karp_flatt(speedup, p):
    """The serial share that explains a measured speedup on p ranks."""
    return (1 / speedup - 1 / p) / (1 - 1 / p)


def serial_share_is_the_machines(lab):
    cells = measure(lab)
    name = "512 per rank"
    # repetition k: its one-rank time against its two-rank time
    t1 = [max(r.step_ms for r in ranks) for ranks in cells[name, 1]]
    t2 = [max(r.step_ms for r in ranks) for ranks in cells[name, 2]]
    speedups = sorted(a / b for a, b in zip(t1, t2))
    measured = sorted(karp_flatt(s, 2) for s in speedups)
    model = MLP(MEASURED)
    priced = {}
    for machine in ("flat-10g", "dgx-h100"):
        topo = PRESETS[machine]
        t_1 = sum(step_time(model, 1024, 1, topo))
        priced[machine] = {}
        for p in (2, 64):
            t_p = sum(step_time(model, 1024 / p, p, topo))
            priced[machine][p] = karp_flatt(t_1 / t_p, p)
    eth, nvl = priced["flat-10g"], priced["dgx-h100"]
    sim = simulated_scaling()
    sim_e = {p: karp_flatt(sim[1][0][0] / sim[p][0][0], p) for p in (8, SIM_PS[-1])}
    return {"sim_e_8": sim_e[8], "sim_e_last": sim_e[SIM_PS[-1]], "sim_last": SIM_PS[-1],
            "sim_cluster": SIM_CLUSTER,"measured": measured, "lo": measured[0], "hi": measured[-1],
            "reps": len(measured), "s_lo": speedups[0], "s_hi": speedups[-1],
            "eth_2": priced["flat-10g"][2], "eth_64": priced["flat-10g"][64],
            "nvl_2": priced["dgx-h100"][2], "nvl_64": priced["dgx-h100"][64],
            "machines": priced["flat-10g"][2] / priced["dgx-h100"][2],
            "nvl_word": "smaller" if nvl[2] < eth[2] else "larger",
            "reading": karp_flatt_reading(measured),
            "example_s": 2 / 3, "example_e": karp_flatt(2 / 3, 2)}


def karp_flatt_reading(shares):
    """What a set of measured Karp-Flatt shares says, in words."""
    n, said = len(shares), []
    for count, where in ((sum(e < 0 for e in shares), "below 0 (noise)"),
                         (sum(e > 1 for e in shares), "above 1 (two ranks slower than one)"),
                         (sum(0 <= e <= 1 for e in shares), "between 0 and 1")):
        if count:
            said.append(f"{count} of the {n} repetitions came out {where}")
    return "In this run " + "; ".join(said) + "."


STEPS = (
    Step(
        title="Communication is not a serial share: T(p) = T_comp/p + T_comm(p)",
        text=("**Strong scaling** keeps the global batch ({batch:,} samples) and adds ranks. Each rank "
              "computes on batch/p samples, so compute shrinks as 1/p; but the all-reduce of the "
              "{params:,}-parameter gradient is **zero on one rank and grows with p** (a ring sends "
              "2(p-1)/p of the gradient, in 2(p-1) messages, each paying a latency α). Priced by the cost "
              "model (lesson 3) on the preset `{link}` (10 Gb/s Ethernet: 1.25 GB/s each way, 5 µs a "
              "message) with a {gflops:g} GFLOP/s device, in ms:\n\n"
              "| p | compute | all-reduce | speedup | with overlap | Amdahl, fitted at p=2 |\n"
              "|---|---|---|---|---|---|\n{table}\n\n"
              "The speedup peaks at p = {best_p} ({best_s:.3g}x) and **falls** after: at p = {last_p} it "
              "is {last_s:.3g}x. Amdahl's law (a share f of the one-rank time that cannot be split) fitted "
              "to the same T(2) gives f = {f_pct:.2g}% and promises {amdahl_last:.3g}x at p = {last_p}: "
              "it assumes the part that does not shrink stays the same size, while communication grows.\n\n"
              "The speedup column adds T_comm to the compute, as if nothing overlapped. Lesson 4's buckets "
              "hide the all-reduce behind backward, 4 of the 6 FLOPs per weight, so at best "
              "T(p) = T_comp/(3p) + max(2 T_comp/(3p), T_comm(p)) (the overlap column): the speedup is "
              "perfect while backward outlasts the all-reduce (up to p = {perfect_to} here), peaks higher, "
              "{best_ov:.3g}x at p = {best_p_ov}, and still falls after, to {last_ov:.3g}x at "
              "p = {last_p}: strong scaling shrinks backward with p until it can no longer hide "
              "communication that grows."),
        run=peak_and_fall,
        checks=(Check("one rank communicates nothing", lambda f: f["comm_1"] == 0),
                Check("the preset is 10 Gb/s Ethernet, 5 µs a message",
                      lambda f: f["link"] == "flat-10g"),
                Check("the all-reduce's time grows with p", lambda f: f["comms"] == sorted(f["comms"])),
                Check("the speedup peaks at p = {best_p} and falls after it",
                      lambda f: 1 < f["best_p"] < f["last_p"] and f["last_s"] < f["best_s"]),
                Check("with overlap the speedup is never lower, perfect up to p = {perfect_to}, and still "
                      "falls after its peak",
                      lambda f: all(o >= s for o, s in zip(f["overlaps"], f["speedups"]))
                      and all(abs(o - p) < 1e-9 * p for o, p in zip(f["overlaps"], WORLD_SIZES)
                              if p <= f["perfect_to"])
                      and f["last_ov"] < f["best_ov"]),
                Check("Amdahl's curve never falls, and overshoots the model at p = {last_p}",
                      lambda f: f["amdahls"] == sorted(f["amdahls"]) and f["amdahl_last"] > f["last_s"])),
        inputs={"batch": 4096, "last_p": WORLD_SIZES[-1]},
        predict=Predict("Global batch {batch:,}, adding ranks from 1 to {last_p}. Does the step ever get "
                        "slower as ranks are added: 'yes' or 'no'?", "falls", choices=("yes", "no"),
                        misconceptions=(("no", "that is Amdahl's picture, where the part that does not "
                                               "shrink stays the same size; communication grows with p"),)),
        hint="Compute falls as 1/p; the ring's 2(p-1) latencies grow as p. Their sum has a minimum.",
        hints=("T(p) = T_comp/p + 2(p-1)α + 2(p-1)/p · n β: which term wins at large p?",),
        show=(flops_per_sample, step_time, overlapped, amdahl),
        picture=lambda f: _bars([(f"p={p}", s) for p, s in zip(WORLD_SIZES, f["speedups"])], "x",
                                title="speedup on the cost model (peaks, then falls)"),
        try_this="Set FLOPS to 1e12 (a GPU) in l05_scaling.py: where does the speedup peak now, and why?",
        explore=Explore("cost"),
        teaches=("amdahl",),
    ),
    Step(
        title="Strong vs weak scaling: samples per rank set compute per byte",
        text=("What keeps communication hidden is **compute per byte sent**: FLOPs a rank does per step "
              "(6 per weight per sample) over the bytes its ring all-reduce sends (2(p-1)/p × the "
              "gradient: 1x at p = 2, nearly 2x at large p). "
              "Parameters appear in both, so they cancel: at {per_rank} samples per rank the small model "
              "({small_params:,} parameters) does {small:.3g} FLOPs per byte and the large one "
              "({params_ratio:.0f}x the parameters) {large:.3g}, {model_ratio:.2f}x. What moves the ratio "
              "is the **samples per rank**.\n\n"
              "That holds where each weight works once per sample: an MLP ({mlp_per_param:.2g} forward "
              "FLOPs per weight per sample) and a transformer, per token (lesson 14's 6 N). A CNN reuses "
              "each weight at every position of its feature maps: ResNet-50, counted from its layer "
              "table, does {cnn_gflops:.1f} GFLOPs forward per 224 × 224 image with {cnn_params:,} "
              "parameters, **{cnn_per_param:.0f} FLOPs per parameter**. For a CNN the model (its "
              "resolution, its layout) sets compute per byte as much as the batch does.\n\n"
              "**Strong scaling** (global batch {global_batch} fixed) divides them by p; **weak scaling** "
              "({per_rank} per rank fixed, the global batch grows with p) keeps them, so its FLOPs per "
              "byte fall only by the ring's 2(p-1)/p: {weak_fall:.2f}x from p = 2 to {p_last}, and never "
              "past 2x. FLOPs per byte of the large model, and weak scaling's speedup priced as in step 1 "
              "(**Gustafson**: p ranks do p times the work, ideally in the same time):\n\n"
              "| p | samples per rank (strong) | strong | weak | weak-scaling speedup |\n"
              "|---|---|---|---|---|\n{table}\n\n"
              "Gustafson's p is an ideal: priced, {p_last} ranks reach {g_last:.3g}x, {g_eff:.0%} of it. "
              "The work per rank is fixed, but the all-reduce's time still grows with p (its 2(p-1) "
              "latencies), and at {per_rank} samples per rank it is {comm_share:.0%} of the step at "
              "p = {p_last}. The bytes are the engine's: a real step on 4 ranks sent {engine_bytes:,} bytes "
              "from rank 0, "
              "the cost model's {model_bytes:,} for the gradient plus {loss_bytes} for the step's loss. "
              "Weak scaling is why data parallelism grows the global batch; lessons 6 and 13 are what a "
              "larger batch costs in learning."),
        run=strong_and_weak,
        checks=(Check("at the same samples per rank the two models' FLOPs per byte are within 2x "
                      "though their sizes differ {params_ratio:.0f}x",
                      lambda f: 0.5 < f["model_ratio"] < 2 and f["params_ratio"] > 100),
                Check("ResNet-50's layer table gives torchvision's 25,557,032 parameters and over 100x an "
                      "MLP's FLOPs per parameter",
                      lambda f: f["cnn_params"] == 25_557_032
                      and f["cnn_per_param"] > 100 * f["mlp_per_param"]),
                Check("strong scaling's FLOPs per byte fall with p",
                      lambda f: f["strong"] == sorted(f["strong"], reverse=True)),
                Check("weak scaling's stay within 2x of their p = 2 value",
                      lambda f: min(f["weak"]) > f["weak"][0] / 2),
                Check("weak scaling's FLOPs per byte fall by the ring's 2(p-1)/p factor (within 1%: "
                      "chunks round up)", lambda f: abs(f["weak_fall"] / f["ring_factor"] - 1) < 0.01),
                Check("weak scaling's priced speedup falls short of Gustafson's p",
                      lambda f: f["g_last"] < f["p_last"]),
                Check("the engine sends the cost model's bytes plus the loss's two float64s",
                      lambda f: f["loss_bytes"] == 16)),
        inputs={"per_rank": 16, "small_params": MLP(SMALL).num_params, "large_params": MLP(LARGE).num_params},
        predict=Predict("Two MLPs: 'small' ({small_params:,} parameters) and 'large' ({large_params:,}). At "
                        "{per_rank} samples per rank, which does more FLOPs per byte it all-reduces: "
                        "'small', 'large' or about the 'same'?", "about", choices=("small", "large", "same"),
                        misconceptions=(("large", "a larger model computes more per sample, but it also "
                                                  "all-reduces more bytes: the parameters cancel"),)),
        hint="FLOPs per sample ≈ 6 × weights; bytes ≈ 2 × 4 × parameters. Divide.",
        hints=("Per byte sent, what is left after the parameters cancel is the samples per rank.",),
        show=(flops_per_sample, step_time, resnet50_counts),
        try_this="dplab scaling --help   # strong and weak scaling for any model and world size",
        teaches=("amdahl", "batch-size"),
    ),
    Step(
        title="Strong and weak scaling on 64 simulated GPUs, and this machine measured",
        text=("**On {sim_gpus} simulated GPUs** (`{sim_cluster}`: nodes of {sim_per_node} {sim_device} "
              "on NVLink, InfiniBand between them; simulated time, the same at any load). A transformer's "
              "matmuls ({sim_blocks} blocks of 12 d² weights at d = {sim_width}: {sim_params:,} "
              "parameters, {sim_tokens:,} tokens a sample) train with DDP: bfloat16 gradients in 25 MiB "
              "buckets, each all-reduced by `{sim_alg}` (lesson 2's two-level all-reduce) while "
              "backward goes on, compute at the device's rated bfloat16 peak. Strong scaling keeps "
              "{sim_global} samples in all; weak scaling gives every GPU {sim_per_gpu}, so at p = "
              "{sim_last} the two are the same run. Step times in ms, and efficiency (strong: "
              "T(1) / (p T(p)); weak: T(1) / T(p)):\n\n"
              "| GPUs | nodes | strong: samples per GPU | strong step | efficiency | weak step | "
              "efficiency |\n|---|---|---|---|---|---|---|\n{sim_table}\n\n"
              "Strong scaling is nearly perfect while a GPU has samples enough for backward to hide the "
              "all-reduce ({eff_strong_8:.2f} on one node of 8), then falls as each GPU's share of the "
              "batch shrinks: "
              "{sim_last} GPUs run {speedup_last:.3g}x faster than one, an efficiency of "
              "{eff_last:.2f}, with {exposed_last_pct:.0f}% of the step spent on communication no "
              "compute hides. Weak scaling keeps the compute and pays only the all-reduce's growth "
              "with p: its step grows {weak_growth:.2f}x from 1 to {sim_last} GPUs, the latencies of "
              "more rounds and, past one node, the slower links. Step 1's cost model said the same; "
              "here it is the DDP step itself, bucket by bucket, on the cluster's links.\n\n"
              "**On this machine** (measured, load {load:.1f} on two shared cores): two ranks train step "
              "1's {measured_params:,}-parameter MLP, {reps} interleaved repetitions, 4 or 512 samples "
              "per rank. Rank 0's trace splits a step (ms, the median run) "
              "into parts that add up: compute, communication with no compute under it, waiting, and the "
              "rest (Python between phases). The last column is (communication + waiting) / compute over "
              "all repetitions, lowest to highest:\n\n"
              "| per rank | step | compute | exposed comm. | waiting | other | (comm + wait) / compute |\n"
              "|---|---|---|---|---|---|---|\n{table}\n\n"
              "The cost model says the ratio at 4 per rank is {priced_x:.0f}x the one at 512 "
              "({priced_few:.2g} against {priced_many:.2g} on 10 Gb/s Ethernet): the all-reduce is the "
              "same, the compute is not. Measured: {verdict}. Two ranks here are two processes on "
              "two cores that other programs share: a rank gets less than a core and waits for the "
              "scheduler as much as for its peer, and its all-reduce runs on the same cores as the "
              "compute, so the times wander with the load where the simulated ones cannot."),
        run=where_time_goes,
        figure=_timeline,
        checks=(Check("simulated: strong scaling's efficiency never rises with p, and ends below 0.9",
                      lambda f: all(a >= b - 1e-12 for a, b in zip(f["eff_strong"], f["eff_strong"][1:]))
                      and f["eff_last"] < 0.9),
                Check("simulated: nearly perfect (above 0.95) on one node of 8",
                      lambda f: f["eff_strong_8"] > 0.95),
                Check("simulated: the weak step only grows with p, by less than 2x to {sim_last} GPUs",
                      lambda f: all(a >= b - 1e-12 for a, b in zip(f["eff_weak"], f["eff_weak"][1:]))
                      and 1 < f["weak_growth"] < 2),
                Check("simulated: at p = {sim_last} strong and weak are the same run",
                      lambda f: f["eff_strong"][-1] == f["eff_weak"][-1]),
                Check("the parts add up to the step", lambda f: f["adds_up"]),
                Check("priced, the ratio at 4 per rank is 128x the one at 512 (same bytes, 1/128 the FLOPs)",
                      lambda f: abs(f["priced_x"] - 128) < 1e-6),
                Check("the verdict on the measurement is the data's (no overlap: it carries)",
                      lambda f: f["carries"] == (f["lo"][0] > f["hi"][-1]))),
        hint="Exposed communication is comm time minus the compute that overlapped it.",
        show=(where_time_goes,),  # the split itself; the measuring loop is in the file
        try_this="dplab train --world-size 2 --trace run.json   # the Runs page shows the same split",
        explore=Explore("runs", lambda f: {"world_size": 2, "hidden": 256}),
        teaches=("amdahl",),
    ),
    Step(
        title="A serial share you measure belongs to the machine, not the code",
        text=("Invert Amdahl on a measured speedup S on p ranks and you get the **Karp-Flatt** serial "
              "share e = (1/S - 1/p) / (1 - 1/p). For the 512-per-rank runs at p = 2, the {reps} "
              "repetitions here measured speedups S from {s_lo:.2f} to {s_hi:.2f}, so e from {lo:.2g} to "
              "{hi:.2g}. Read e by its range. Between 0 and 1 it is a share. Below 0 it means S > p, "
              "better than perfect: no code does that, so there it is noise. Above 1 it means S < 1, two "
              "ranks slower than one (at p = 2, e = 2/S - 1: S = {example_s:.2f} reads as e = "
              "{example_e:.2g}): that is no share "
              "of anything, it is the machine. Here two ranks share two cores with other work, so each "
              "gets less than a core, and they pay the all-reduce besides. {reading} The spread is a fact "
              "about this machine today, not about the code.\n\n"
              "Price the same code on two clusters instead: e = {eth_2:.2g} on 10 Gb/s Ethernet but "
              "{nvl_2:.2g} on NVLink ({machines:.0f}x smaller) at p = 2. And it is no constant: on "
              "Ethernet it grows to {eth_64:.2g} at p = 64, because communication grows with p. A serial "
              "share, measured or priced, describes one machine at one p. Step 3's simulated strong "
              "scaling on `{sim_cluster}`, with no noise at all, gives e = {sim_e_8:.2g} at p = 8 and "
              "{sim_e_last:.2g} at p = {sim_last}: it grows with p there too."),
        run=serial_share_is_the_machines,
        checks=(Check("the same code has a serial share over 10x larger on Ethernet than on NVLink",
                      lambda f: f["machines"] > 10),
                Check("and it grows with p (Amdahl's f would stay put)", lambda f: f["eth_64"] > f["eth_2"]),
                Check("simulated: the serial share of step 3's strong scaling grows from p = 8 to "
                      "{sim_last}", lambda f: 0 <= f["sim_e_8"] < f["sim_e_last"]),
                Check("the measured share is shown over all {reps} repetitions",
                      lambda f: f["reps"] == REPS),
                Check("the reading counts every repetition once, in its range",
                      lambda f: f["reading"] == karp_flatt_reading(f["measured"]))),
        predict=Predict("Priced on NVLink instead of 10 Gb/s Ethernet, is the serial share of the same "
                        "step 'larger', 'smaller' or the 'same'?", "nvl_word",
                        choices=("larger", "smaller", "same"),
                        misconceptions=(("same", "the serial share is not a property of the code: it is "
                                                 "T_comm against T_comp on one machine"),)),
        hint="Karp-Flatt: e = (1/S - 1/p) / (1 - 1/p); faster links shrink T_comm, and with it e.",
        show=(karp_flatt, step_time),
        try_this="Price the step on PRESETS['h100-100g'] in serial_share_is_the_machines.",
        teaches=("amdahl",),
    ),
)


LESSON = Lesson(5, "scaling", "Scaling: T(p) = T_comp/p + T_comm(p), strong vs weak",
                "Why the speedup peaks and falls, why the batch per rank (not the model) sets compute per "
                "byte, and what a measured serial share means.", STEPS)
