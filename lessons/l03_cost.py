"""Lesson 3: the alpha-beta-gamma cost model against measurements.

    dplab lesson 3

Five steps: the model prices any schedule (and agrees with the textbook formulas); fit alpha,
beta, gamma to four all-reduces on a simulated DGX H100 node (the cluster file's values come
back), then to the same measured here, with each row's spread and the residuals shown (on two
shared cores the fit is the method, not this machine's numbers); the
crossover between latency-bound and bandwidth-bound in the model, and a paired measurement that
claims an order only when every repetition agrees; the cheapest of the registry's schedules per
(world size, message size) on a cluster, and one it lacks; and what ``algorithm="auto"`` picks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from dplab.backends import allreduce
from dplab.backends.bench.timing import bench_rank, summarize
from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAYS
from dplab.lessons.l02_allreduce import rings_per_nic
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference import auto
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.columns import columns
from dplab.reference.costfit import fit, terms
from dplab.reference.costmodel import best_regions, closed_form, cost, region_algorithms
from dplab.reference.topology import PRESETS
from dplab.viz.cost import format_bytes

__all__ = ["LESSON"]

KIB, MIB = 1 << 10, 1 << 20
BENCH_ALGORITHMS = ["ring", "tree", "recursive_doubling", "naive"]  # rd reduces all it receives: gamma
BENCH_SIZES = [4 * KIB, 64 * KIB, MIB]
BENCH_REPS = 5
SMALL_REPS = 9  # the 4 KiB claim of the crossover step: more repetitions, the claim rests on it
CLUSTER_PS = (2, 4, 8, 16, 32, 64, 128)
CLUSTER_SIZES = tuple(1 << k for k in range(10, 31, 2))  # 1 KiB .. 1 GiB
CLUSTER_ALGORITHMS = region_algorithms(PRESETS["dgx-h100"])
TABLE_SIZES = (KIB, MIB, 1 << 30)  # the text's table; the figure has them all


def model_prices_schedules(lab):
    p, n = 4, MIB
    # 5 µs a message, 10 GB/s links, 25 GB/s adds
    alpha, beta, gamma = 5e-6, 1 / 10e9, 1 / 25e9
    names = ("naive", "ring", "tree", "recursive_doubling", "rabenseifner")
    walked = {a: cost(allreduce_schedule(a, p), n, alpha, beta, gamma,
                      itemsize=4).time
              for a in names}
    textbook = {a: closed_form(a, p, n, alpha, beta, gamma) for a in names}
    table = "\n".join(
        f"| {a} | {walked[a] * 1e6:.1f} | {textbook[a] * 1e6:.1f} |"
        for a in names)
    worst = max(abs(walked[a] / textbook[a] - 1) for a in names)
    return {"p": p, "n_bytes": n,
            "ring_us": walked["ring"] * 1e6,
            "table": table,
            "worst": worst}


def bench_here(lab):
    """Time four all-reduces at three sizes on 4 local ranks, as
    `dplab bench` does (kept for the lesson's later steps: measuring
    is the slow part). Each row also says how far its repetitions
    spread: (slowest - fastest) / median."""
    if "l03_rows" not in lab.scratch:
        # warm-up 2, 30 ms a cell, at most 2000 calls
        ranks = lab.world(4).run(bench_rank, BENCH_ALGORITHMS, BENCH_SIZES,
                                 "float32", 2, 0.03, 2000, BENCH_REPS)
        rows = summarize("local", 4, ranks)
        for i, row in enumerate(rows[:len(ranks[0]["allreduce"])]):
            reps = _per_rep(ranks, i)
            row["spread_pct"] = 100 * np.ptp(reps) / np.median(reps)
        lab.scratch["l03_rows"] = [r for r in rows
                                   if r["algorithm"] != "memcpy"]
    return lab.scratch["l03_rows"]


def _per_rep(ranks, cell):
    """A cell's time per repetition: the mean over the ranks, as summarize takes it."""
    return np.mean([r["allreduce"][cell]["times"] for r in ranks], axis=0)


SIM_CLUSTER = "dgx-h100"   # one simulated DGX H100 node: 8 GPUs on NVLink through NVSwitch
SIM_SIZES = [4 * KIB, 64 * KIB, MIB, 16 * MIB]


def fit_simulated(cluster=SIM_CLUSTER, p=8):
    """Time the four all-reduces on a simulated node, as `dplab bench
    --backend sim` does, and fit α, β, γ to those rows: the cluster
    file's own values come back."""
    from dplab.backends.sim.timing import bench_rows
    from dplab.reference.cluster import cluster as named
    c = named(cluster)
    rows = [r for r in bench_rows(c, p, BENCH_ALGORITHMS, SIM_SIZES)
            if r["algorithm"] != "memcpy"]
    (model,) = fit(rows)
    link = c.link(0, 1)  # every pair of GPUs: one NVLink hop
    return model, {"alpha": link.alpha, "beta": link.beta,
                   "gamma": c.gamma}, c


def measure_and_fit(lab):
    sim, truth, c = fit_simulated()
    found = {"alpha": sim.alpha, "beta": sim.beta, "gamma": sim.gamma}
    off = max(abs(found[k] / truth[k] - 1) for k in truth)
    simulated = {
        "sim_cluster": c.name, "sim_p": 8, "sim_device": c.device.name,
        "sim_link": c.link(0, 1).name, "sim_rows": len(sim.rows),
        "sim_sizes": ", ".join(map(format_bytes, SIM_SIZES)),
        "sim_alpha_us": sim.alpha * 1e6, "sim_beta_is": _per_byte(sim.beta, 4),
        "sim_gamma_is": _per_byte(sim.gamma, 4),
        "file_alpha_us": truth["alpha"] * 1e6,
        "file_gbps": 1e-9 / truth["beta"],
        "file_mem_gbps": c.device.memory_bytes_s / 1e9,
        "file_gamma_gbps": 1e-9 / truth["gamma"],
        "sim_off": off, "sim_rms": sim.summary()["rms_residual_pct"],
        "load": os.getloadavg()[0]}
    rows = bench_here(lab)
    # one fit for the backend: alpha, beta, gamma
    (model,) = fit(rows)
    spread = {(r["algorithm"], r["bytes"]): r["spread_pct"] for r in rows}
    table = "\n".join(
        f"| {r['algorithm']} | {r['bytes']:,} | {r['measured_us']:,.0f} | "
        f"{spread[r['algorithm'], r['bytes']]:.0f}% | "
        f"{r['fitted_us']:,.0f} | {r['residual_pct']:+.0f}% |"
        for r in model.residuals())
    rms = model.summary()["rms_residual_pct"]
    # each fitted value 10% off
    nudged = [rms_of(replace(model, **{k: getattr(model, k) * s}))
              for k in ("alpha", "beta", "gamma") if getattr(model, k)
              for s in (0.9, 1.1)]
    abg = (model.alpha, model.beta, model.gamma)
    spreads = sorted(spread.values())
    zeroed = [n for n, v in (("α", model.alpha), ("β", model.beta),
                             ("γ", model.gamma)) if v == 0]
    return simulated | {"p": 4, "fit": model,
            "spread_max": spreads[-1],
            "spread_median": float(np.median(spreads)),
            "ring_1m_terms": _terms_text("ring", 4, MIB),
            "alpha_us": model.alpha * 1e6,
            "rows": len(rows), "reps": BENCH_REPS,
            "sizes": ", ".join(map(format_bytes, BENCH_SIZES)),
            "beta_is": _per_byte(model.beta),
            "gamma_is": _per_byte(model.gamma),
            "note": model.note or "none",
            "zeroed": zeroed, "zero_said": zero_said(zeroed),
            "alike": columns_alike(rows),
            "rms": rms, "table": table,
            "least": all(x >= rms - 1e-6 for x in nudged),
            "nudged": len(nudged),
            "nonnegative": all((v or 0.0) >= 0 for v in abg)}


def columns_alike(rows):
    """How parallel the β and γ columns of the fit's equations are (the
    cosine of their angle, rows weighted as the fit weighs them): near 1,
    the rows cannot tell a byte sent from a byte added."""
    x = np.array([terms(r["algorithm"], r["world_size"], r["bytes"])
                  for r in rows])
    w = 1 / np.array([r["time_us"] for r in rows])
    b, g = x[:, 1] * w, x[:, 2] * w
    return float(b @ g / (np.linalg.norm(b) * np.linalg.norm(g)))


def zero_said(zeroed):
    """What the fit did with the terms it set to 0, in words."""
    if "α" in zeroed:  # on a loaded machine even the latency can lose
        kept = " and ".join(n for n in ("β", "γ") if n not in zeroed)
        return (f"{' and '.join(zeroed)} came out exactly 0: the fit keeps "
                "every value ≥ 0, and the best unconstrained fit wanted a "
                f"negative value, so it left all the cost to {kept or 'none'}.")
    if not zeroed:
        return "Both per-byte terms came out positive."
    if len(zeroed) == 2:
        return ("β and γ both came out exactly 0: the fit keeps every value "
                "≥ 0, and the best unconstrained fit wanted them negative, so "
                "it dropped them and left all the cost to α.")
    (gone,), kept = zeroed, "γ" if zeroed == ["β"] else "β"
    return (f"{gone} came out exactly 0: the fit keeps every value ≥ 0, and "
            f"the best unconstrained fit wanted a negative {gone}, so it "
            f"dropped {gone} and left all the per-byte cost to {kept}.")


def rms_of(model):
    """The fit's objective: the root mean square of each row's
    residual relative to its time."""
    pct = [r["residual_pct"] for r in model.residuals()]
    return float(np.sqrt(np.mean([x ** 2 for x in pct])))


def _terms_text(algorithm, p, n):
    """The row's equation, read off the schedule: a α + b β + c γ."""
    a, b, c = terms(algorithm, p, n)
    return f"{a:g} α + {b:,.0f} β + {c:,.0f} γ"


def _per_byte(seconds, digits=3):
    return f"1/({1e-9 / seconds:.{digits}g} GB/s)" if seconds else "0"


def _residuals(facts):
    from dplab.viz.cost_fit import Fit, residual_figure
    f = facts["fit"]
    return residual_figure([Fit(f.backend, f.algorithm, f.alpha, f.beta, f.rows, f.note, f)])


def crossover(lab):
    from dplab.viz.cost import CostParams
    from dplab.viz.cost_crossovers import crossovers
    ring, rd = "ring", "recursive_doubling"
    textbook = CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8,
                          algorithms=(ring, "tree", rd))
    said = {(c.faster_below, c.faster_above): c.nbytes
            for c in crossovers(textbook)}
    # 4 KiB on 4 local ranks, ring and rd interleaved: paired repetitions
    ranks = lab.world(4).run(bench_rank, [ring, rd], [4 * KIB], "float32",
                             3, 0.05, 2000, SMALL_REPS)
    ratios = _per_rep(ranks, 0) / _per_rep(ranks, 1)  # ring / rd, per rep
    lo, hi = float(ratios.min()), float(ratios.max())
    rounds = {a: len(allreduce_schedule(a, 4).rounds) for a in (ring, rd)}
    m64 = 64 * MIB
    return {"reps": SMALL_REPS, "p": 8, "alpha_us": 5, "gbps": 10,
            "ring_rounds": rounds[ring], "rd_rounds": rounds[rd],
            "tree_below_kib": said["tree", ring] / KIB,
            "rd_below_kib": said[rd, ring] / KIB,
            "rd_below_bytes": said[rd, ring],
            "lo": lo, "hi": hi, "median_ratio": float(np.median(ratios)),
            "claims_order": lo > 1 or hi < 1,
            "measured": _measured(lo, hi, rounds[ring], rounds[rd]),
            "model_ratio_64m": model_time(rd, m64) / model_time(ring, m64)}


def _measured(lo, hi, ring_rounds, rd_rounds):
    """What the paired repetitions can say: an order only if all agree."""
    span = f"the ring took {lo:.2f}x to {hi:.2f}x recursive doubling's time"
    if lo > 1:
        return (f"recursive doubling was faster in every repetition ({span}): "
                f"its {rd_rounds} rounds against the ring's {ring_rounds} show "
                "through the noise")
    if hi < 1:
        return (f"the ring was faster in every repetition ({span}): on this "
                "machine, now, something other than the rounds dominates, and "
                "the model's order does not show")
    return (f"the repetitions disagree ({span}): on a machine this busy they "
            "cannot order the two, so the lesson claims no order from them")


def model_time(algorithm, nbytes, p=8):
    """The textbook setting: alpha 5 µs, 10 GB/s links, free adds."""
    schedule = allreduce_schedule(algorithm, p)
    return cost(schedule, nbytes, 5e-6, 1e-10, 0.0, itemsize=4).time


def _crossover_figure(facts):
    from dplab.viz.cost import CostParams
    from dplab.viz.cost_figure import cost_figure
    return cost_figure(CostParams(alpha_s=5e-6, beta_gbps=10, world_size=8,
                                  algorithms=("ring", "tree", "recursive_doubling")))


def cluster_regions(lab):
    # 8 GPUs a node on NVLink, InfiniBand between
    topo = PRESETS["dgx-h100"]
    ps, sizes = CLUSTER_PS, CLUSTER_SIZES
    # the engine's array builders: the same schedules, built in milliseconds at p = 128
    regions = best_regions(topo, ps, sizes, builders=ARRAYS)
    win = {(p, n): regions.algorithms[regions.winner[i, j]]
           for i, p in enumerate(ps) for j, n in enumerate(sizes)}
    small, large = sizes[0], sizes[-1]
    alphas = {p: (terms(win[p, small], p, small)[0],
                  terms(win[p, large], p, large)[0])
              for p in ps}

    def sent_by_busiest(p):
        schedule = allreduce_schedule(win[p, large], p)
        return cost(schedule, large, 0, 0, 0, itemsize=4).bytes_sent_max

    least = {p: sent_by_busiest(p) / (2 * (p - 1) / p * large) for p in ps}
    # the share of the 64-GPU winner's transfers (equal chunks) that stay inside a node
    t64, g = columns(allreduce_schedule(win[64, large], 64)), topo.ranks_per_node
    nvlink_64 = float(np.mean(t64.src // g == t64.dst // g))
    table = "\n".join(
        f"| {p} | " + " | ".join(win[p, n] for n in TABLE_SIZES) + " |"
        for p in ps)
    hier = all(win[p, large].startswith("hierarchical") for p in ps if p > 8)
    # a schedule the registry does not hold: NCCL's way, a ring per NIC
    per_nic = cost(rings_per_nic(64, topo.ranks_per_node), large, itemsize=4,
                   topology=topo).time
    registry = cost(allreduce_schedule(win[64, large], 64), large,
                    itemsize=4, topology=topo).time
    return {"regions": regions, "table": table,
            "rpn_64_ms": per_nic * 1e3, "best_64_ms": registry * 1e3,
            "small_64": win[64, small],
            "large_64": win[64, large], "nvlink_64": nvlink_64, "g": g,
            "small_winners": ", ".join(sorted({win[p, small] for p in ps})),
            "large_winners": ", ".join(sorted({win[p, large] for p in ps})),
            "alphas": alphas,
            "least": least,
            "hier_multi_node": hier}


def _regions_figure(facts):
    from dplab.viz.cost_regions import regions_figure
    return regions_figure(facts["regions"])


def traced_auto(comm, nbytes):
    buf = comm.empty(nbytes // 4, np.float32)
    buf[:] = 1
    comm.tracer.enabled = True
    # auto: the fitted model picks, per size
    allreduce(comm, buf, algorithm="auto")
    comm.tracer.enabled = False
    sends = [e for e in comm.tracer.take() if e.kind == "send"]
    ran = {e.algorithm for e in sends}
    return {"chosen": auto.chosen(comm, buf),
            "ran": sorted(ran),
            "sum": float(buf[0])}


def what_auto_picks(lab):
    # $DPLAB_TUNE, ~/.cache/dplab/tune.json or built in
    p, tuning = 4, auto.current()
    small, large = 4 * KIB, 16 * MIB
    picks, ran, ok = {}, {}, True
    for n in (small, large):
        ranks = lab.world(p).run(traced_auto, n)
        picks[n] = ranks[0]["chosen"]
        ran[n] = ranks[0]["ran"]
        priced = {a: tuning.predict_s("local", a, p, n)
                  for a in tuning.candidates("local")}
        cheapest = min((t, i, a) for i, (a, t) in enumerate(priced.items())
                       if t is not None)[2]
        ok &= (picks[n] == cheapest
               and len({r["chosen"] for r in ranks}) == 1
               and all(r["sum"] == p for r in ranks))
    schedule = {n: "direct" if a == "native"
                else allreduce_schedule(a, p).name
                for n, a in picks.items()}
    return {"p": p, "source": tuning.source,
            "small": picks[small],
            "large": picks[large],
            "consistent": ok,
            "ran_as_chosen": all(ran[n] == [schedule[n]] for n in picks),
            "ran_small": ", ".join(ran[small]),
            "ran_large": ", ".join(ran[large])}


STEPS = (
    Step(
        title="The α-β-γ model prices any schedule",
        text=("Sending a message of m bytes costs α + m β; adding m bytes costs m γ. The model walks a "
              "schedule round by round and charges each round its slowest rank. At p={p}, {n_bytes:,} bytes, "
              "α = 5 µs, β = 1/(10 GB/s), γ = 1/(25 GB/s), the walk and the textbook formulas "
              "(Thakur, Rabenseifner & Gropp 2005) give, in µs:\n\n"
              "| algorithm | walk of the schedule | textbook |\n|---|---|---|\n{table}\n\n"
              "They agree to {worst:.0e}: the model is the schedule, priced. The ring: 2(p-1) α "
              "+ 2(p-1)/p n β "
              "+ (p-1)/p n γ = {ring_us:.1f} µs."),
        run=model_prices_schedules,
        checks=(Check("the walk equals the textbook formula for all five (to 1e-9)",
                      lambda f: f["worst"] < 1e-9),),
        predict=Predict("In the model (α = 5 µs, 10 GB/s links, 25 GB/s adds), how many µs does a ring "
                        "all-reduce of {n_bytes:,} bytes take at p={p}?", "ring_us", rel_tol=0.05, unit="µs",
                        misconceptions=(
                            (lambda g, f: abs(g - (f["ring_us"] - 30)) < 0.05 * f["ring_us"],
                             "about 30 µs short: one term is missing, either the 6 latencies (6 α = 30 µs) "
                             "or the adds ((p-1)/p n γ ≈ 31 µs)"),
                            (lambda g, f: abs(g - (f["ring_us"] + 52)) < 0.05 * f["ring_us"],
                             "2n β is where the ring's bytes tend as p grows; at p = 4 it sends 1.5 n"))),
        hint="Three terms: latencies, bytes sent, bytes added. The ring has 2(p-1) = 6 messages on its path.",
        hints=("It sends 2(p-1)/p n = 1.5 MiB and adds (p-1)/p n = 0.75 MiB.",
               "6 α = 30 µs; 1.5 MiB at 10 GB/s ≈ 157 µs; 0.75 MiB at 25 GB/s ≈ 31 µs."),
        show=("dplab.reference.costmodel.closed_form",),
        inputs={"p": 4, "n_bytes": MIB},
        try_this="dplab app   # Cost page: the same model as curves over message size",
        explore=Explore("cost", lambda f: {"p": f["p"], "alpha_us": 5.0, "beta_gbps": 10.0, "gamma": "25"}),
        teaches=("cost-model",),
    ),
    Step(
        title="Measure, then fit α, β, γ",
        text=("How would you find α, β and γ for a real machine? Measure, then fit. Each timed all-reduce "
              "is one linear equation, time = a α + b β + c γ, with (a, b, c) read off the schedule (the "
              "ring at 1 MiB on 4 ranks: {ring_1m_terms}); least squares over the rows gives the three.\n\n"
              "**On a simulated DGX H100 node** (`{sim_cluster}`: {sim_p} {sim_device} on "
              "{sim_link}; simulated time). `dplab bench --backend sim` times ring, tree, recursive "
              "doubling and naive at {sim_sizes}: {sim_rows} rows, each a run of the schedule's "
              "messages through the cluster's ports. The fit gives α = {sim_alpha_us:.3g} µs, β = "
              "{sim_beta_is}, γ = {sim_gamma_is}, and the cluster file says α = {file_alpha_us:.3g} µs, "
              "{file_gbps:.0f} GB/s links, and a reduction that moves 3 bytes per byte reduced at the "
              "memory's {file_mem_gbps:,.0f} GB/s, γ = 1/({file_gamma_gbps:.4g} GB/s): recovered to "
              "{sim_off:.0e}, the residuals {sim_rms:.0e}% rms. On one NVSwitch node each GPU has a "
              "port of its own, nothing contends, and every row is exactly a α + b β + c γ: the method "
              "works, and the rows tell a byte sent (β) from a byte added (γ) because the four schedules "
              "reduce different shares of what they send.\n\n"
              "**On this machine** (measured, load {load:.1f} on two cores shared with other work). {p} "
              "local ranks time the same four at {sizes} (loops, algorithms interleaved, the median of "
              "{reps} repetitions); least squares over the {rows} rows gives "
              "α = {alpha_us:.1f} µs, β = {beta_is}, γ = {gamma_is} (note: {note}).\n\n"
              "| algorithm | bytes | measured µs | spread | fitted µs | residual |\n"
              "|---|---|---|---|---|---|\n{table}\n\n"
              "Here the numbers cannot carry more than the method: a row's repetitions spread by up to "
              "{spread_max:.0f}% (median {spread_median:.0f}%), and the fit misses by {rms:.0f}% rms. These "
              "ranks are processes sharing two busy cores, not GPUs on a network: a rank waits for the "
              "scheduler as much as for a peer, and a byte moved costs about what a byte added does "
              "(memory bandwidth). The rows barely tell the two apart: the β and γ columns of the {rows} "
              "equations point the same way to a cosine of {alike:.3f} (1: parallel). {zero_said} Read "
              "α, β, γ here as this run's, not this machine's. What holds whatever the load: the values "
              "are least squares (moving any of them 10% either way, {nudged} tries, fits worse) and "
              "none is negative."),
        run=measure_and_fit,
        checks=(Check("simulated: the fit recovers the cluster file's α, β and γ (to 1e-6)",
                      lambda f: f["sim_off"] < 1e-6),
                Check("simulated: every row is a α + b β + c γ (residuals under 1e-6%)",
                      lambda f: f["sim_rms"] < 1e-6),
                Check("no value comes out negative", lambda f: f["nonnegative"]),
                Check("least squares: 10% off any fitted value fits worse", lambda f: f["least"]),
                Check("the rows barely separate a byte sent from a byte added: cosine > 0.9",
                      lambda f: f["alike"] > 0.9),
                Check("what the text says of the per-byte terms is what the fit returned",
                      lambda f: f["zero_said"] == zero_said(
                          [n for n, v in (("α", f["fit"].alpha), ("β", f["fit"].beta),
                                          ("γ", f["fit"].gamma)) if v == 0])),
                Check("the spread of the repetitions is reported for every row",
                      lambda f: f["table"].count("%") == 2 * f["rows"])),
        figure=_residuals,
        hint="Relative least squares: a 4 KiB row (nearly all α) weighs as much as a 1 MiB row.",
        show=("dplab.reference.costfit.fit", "dplab.reference.costfit.terms"),
        try_this="dplab tune --world-sizes 2,4   # the same fit, every algorithm, saved for algorithm='auto'",
        explore=Explore("cost", lambda f: {"p": 4, "source": "run", "bench_world_sizes": 4}),
        teaches=("cost-model",),
    ),
    Step(
        title="Crossover: latency-bound below, bandwidth-bound above",
        text=("In the model at p={p} (α = {alpha_us} µs, {gbps} GB/s, free adds), the tree beats the ring "
              "below **{tree_below_kib:.1f} KiB** and recursive doubling beats it below "
              "**{rd_below_bytes:,.0f} bytes ({rd_below_kib:.0f} KiB)**: few rounds win while the message is "
              "small (latency-bound), few "
              "bytes win once it is large (bandwidth-bound; at 64 MiB recursive doubling takes "
              "{model_ratio_64m:.1f}x the ring's time).\n\n"
              "Measured here at 4 KiB on 4 local ranks, {reps} repetitions with the two interleaved (so each "
              "pair shares the machine's mood): {measured}. A measurement carries a claim only when its "
              "spread is smaller than the effect; near a crossover, and on a machine this busy, it rarely "
              "is."),
        run=crossover,
        checks=(Check("model: the tree's crossover with the ring lies below recursive doubling's",
                      lambda f: f["tree_below_kib"] < f["rd_below_kib"]),
                Check("model: the ring wins large messages (64 MiB) by > 1.2x",
                      lambda f: f["model_ratio_64m"] > 1.2),
                Check("model: recursive doubling's crossover is where 11 α = (3 - 1.75) n β, 440,000 bytes "
                      "(to 1%)", lambda f: abs(f["rd_below_bytes"] / (11 * 5e-6 * 10e9 / 1.25) - 1) < 0.01),
                Check("measured: an order is claimed only when all {reps} paired repetitions agree",
                      lambda f: f["claims_order"] == (f["lo"] > 1 or f["hi"] < 1)
                      and ("disagree" in f["measured"]) != f["claims_order"])),
        figure=_crossover_figure,
        predict=Predict("In the model at p={p} (α = {alpha_us} µs, {gbps} GB/s links, free adds): below "
                        "what message size, in bytes, does recursive doubling beat the ring?",
                        "rd_below_bytes", rel_tol=0.15, unit="bytes", misconceptions=(
                            (lambda g, f: abs(g / f["rd_below_bytes"] - 4) < 0.6,
                             "about 4x too large: n counts bytes here, not float32 elements"),)),
        hint="Write both times: ring 2(p-1) α + 2(p-1)/p n β; recursive doubling lg p α + lg p n β.",
        hints=("At p = 8: 14 α + 1.75 n β against 3 α + 3 n β. Set them equal.",
               "11 α = 1.25 n β, so n = 11 α / (1.25 β) = 11 × 5 µs × 10 GB/s / 1.25."),
        show=("dplab.reference.costmodel.cost",),
        inputs={"p": 8, "alpha_us": 5, "gbps": 10},
        try_this="dplab bench --world-sizes 4 --algorithms ring,recursive_doubling --sizes 4K,1M,16M",
        explore=Explore("cost", lambda f: {"p": 8, "alpha_us": 5.0, "beta_gbps": 10.0,
                                           "algorithms": "ring,tree,recursive_doubling"}),
        teaches=("cost-model", "bandwidth-latency"),
    ),
    Step(
        title="The cheapest all-reduce per region, at cluster scale",
        text=("On DGX H100 nodes (8 GPUs on NVLink, InfiniBand between; reference/topology.py), the model "
              "prices every registered schedule at every world size and message size and keeps the "
              "cheapest (the figure has every size from 1 KiB to 1 GiB):\n\n"
              "| p | 1 KiB | 1 MiB | 1 GiB |\n|---|---|---|---|\n{table}\n\n"
              "Small messages go to {small_winners}: the fewest latencies. Large ones to {large_winners}: "
              "the fewest bytes, and once there is more than one node the hierarchical all-reduce, which "
              "sends only a 1/{g} piece between nodes, on every GPU's NIC, and keeps the rest on NVLink "
              "({nvlink_64:.0%} of its bytes at 64 GPUs). At 64 GPUs: {small_64} for 1 KiB, "
              "{large_64} for 1 GiB.\n\n"
              "That is the best of *these* schedules, the ones dplab's registry holds, and the map is only "
              "as good as that list. A ring per NIC (lesson 2, step 7), which it does not hold, prices at "
              "{rpn_64_ms:.1f} ms for 1 GiB on 64 GPUs against {large_64}'s {best_64_ms:.1f} ms; NCCL also "
              "runs trees between nodes, and NVLS, which adds in the NVSwitch."),
        run=cluster_regions,
        checks=(Check("at every p, the small-message winner pays no more latencies than the large one",
                      lambda f: all(a <= b for a, b in f["alphas"].values())),
                Check("at every p, the large-message winner sends the least a schedule here can, 2(p-1)/p n",
                      lambda f: all(abs(x - 1) < 1e-9 for x in f["least"].values())),
                Check("past one node (p > 8), 1 GiB goes hierarchical among the registry's schedules",
                      lambda f: f["hier_multi_node"]),
                Check("at 64 GPUs it keeps 8/9 of its bytes on NVLink: 2·7/8 n inside the nodes against "
                      "2·7/8 of an n/8 piece between them",
                      lambda f: abs(f["nvlink_64"] - 8 / 9) < 1e-12),
                Check("a ring per NIC, not in the registry, is cheaper still at 1 GiB on 64 GPUs",
                      lambda f: f["rpn_64_ms"] < f["best_64_ms"])),
        figure=_regions_figure,
        predict=Predict("On DGX H100 nodes, which of dplab's schedules does the model pick for a 1 GiB "
                        "all-reduce on 64 GPUs? (new here: direct, every rank sends each chunk straight to "
                        "its owner, then the owners send the sums to all; pipelined_tree and "
                        "pipelined_ring cut the buffer into pieces that follow one another through a "
                        "tree or a ring; hierarchical:8, lesson 2's two-level ring, with groups of 8)",
                        "large_64", choices=CLUSTER_ALGORITHMS, misconceptions=(
                            ("ring", "the ring sends the fewest bytes, but one ring crosses between nodes "
                                     "through one NIC per node boundary while the others idle (lesson 2, "
                                     "step 7)"),)),
        hint="A 1 GiB message is bandwidth-bound, and the slow links are the ones between nodes.",
        hints=("Which schedule keeps most bytes on NVLink and puts every NIC to work?",),
        show=("dplab.reference.costmodel.best_regions",),
        try_this="dplab app   # Cost page, 'Map the cheapest schedule': try the h100-100g preset",
        explore=Explore("cost", lambda f: {"p": 16}),
        teaches=("cost-model", "bandwidth-latency"),
    ),
    Step(
        title="What algorithm='auto' picks",
        text=("`allreduce(comm, buf, algorithm=\"auto\")` prices every candidate with the fitted model "
              "(here from: {source}) and runs the cheapest, per size. On {p} local ranks it chose "
              "**{small}** for 4 KiB and **{large}** for 16 MiB, and the trace shows what really ran: "
              "{ran_small} and {ran_large}. Every rank computes the same choice from the same fit, so "
              "they never disagree. `dplab tune` measures this machine and writes the fit auto reads."),
        run=what_auto_picks,
        checks=(Check("auto's choice is the cheapest candidate in the fit, the same on every rank, and sums "
                      "correctly", lambda f: f["consistent"]),
                Check("the trace shows the chosen schedule ran", lambda f: f["ran_as_chosen"])),
        hint="auto.choose('local', 4, nbytes) is what a rank asks; the answer is cached per size.",
        show=("dplab.reference.auto.choose",),
        try_this="dplab tune --world-sizes 4 && dplab bench --world-sizes 4 --algorithms auto,ring,native",
        explore=Explore("cost", lambda f: {"p": f["p"]}),
        teaches=("cost-model",),
    ),
)


LESSON = Lesson(3, "cost", "The α-β-γ cost model against measurements",
                "How to price an all-reduce, fit the model to what this machine measures, and read where "
                "each algorithm wins.", STEPS)
