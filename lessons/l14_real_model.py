"""Lesson 14: a real model. A character-level GPT trained with dplab's DDP and FSDP on gloo.

    dplab lesson 14              # needs the torch extra: pip install -e ".[torch]"

Six steps: the model and what a token of training costs (6 N FLOPs); DDP and FSDP on two
forked gloo ranks equal to one process; tokens per second and MFU on 8 simulated H100s (the model
at GPT-2 small's size, priced by ``priced.py``), beside this core's matmul utilisation measured
here; where a step's time goes, simulated and from dplab's trace here (a wait split into the other
rank's lag and the all-reduce, and why two ranks here are slower than one process), and FSDP's
bytes against DDP's; the same model on a GPU when there is one; and one step under torch.profiler
beside dplab's trace. The model and its generated text: ``chargpt.py``.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time

import numpy as np

from dplab.lessons.step import Check, Lesson, Predict, Step

__all__ = ["LESSON"]

N_MATMUL = 338_592      # the model's parameters in matmuls (step 1 checks it against torch's count)
ROWS = 8                # the global batch: 8 windows of 32 characters = 256 tokens a step
REPEATS = 3             # timed repeats of a few steps each: the spread is part of the answer
STEPS_PER_REPEAT = 2
BLOCK, WIDTH = 32, 96   # GPTConfig's context and width (step 5's test checks them against it)
GPU_ROWS = 256          # step 5's batch on a GPU: 256 windows of BLOCK characters
H100 = "dgx-h100"       # 8 simulated H100 SXM on NVLink (reference/clusters/dgx-h100.json)
H100_ROWS = 16          # windows of 1,024 characters per GPU, at GPT-2 small's size


def _warm():
    """Import, in this process, what the ranks will need, before they fork from it: torch's first
    AdamW pulls in modules that take seconds to import, and each forked rank would pay that again."""
    import torch

    import dplab.backends.nn.ddp  # noqa: F401
    import dplab.backends.nn.fsdp  # noqa: F401
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def peak_flops(device="cpu", n=384, reps=5, clock=time.perf_counter):
    """This process's best matmul rate, FLOP/s: 2 n³ per n × n matmul,
    the best of ``reps``, timed by ``clock`` (wall, or this thread's CPU)."""
    import torch
    a = torch.randn(n, n, device=device)
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = clock()
        for _ in range(4):
            a @ a
        _sync(device)
        best = min(best, (clock() - t0) / 4)
    return 2 * n ** 3 / best


def _sync(device):
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


def train(comm, wrap, steps, dtype_name="float64", rows=ROWS):
    """Train ``steps`` steps on this rank's rows of each global batch.
    ``wrap``: "ddp", "fsdp" or "none" (one process, every row)."""
    import torch

    from dplab.backends.nn.ddp import DDP
    from dplab.backends.nn.fsdp import FSDP
    from dplab.lessons.chargpt import CharGPT, GPTConfig, batch, encode, text
    torch.set_num_threads(1)  # one core per rank
    torch.set_default_dtype(getattr(torch, dtype_name))
    cfg, data = GPTConfig(), encode(text())
    model = CharGPT(cfg)
    p, r = (1, 0) if wrap == "none" else (comm.world_size, comm.rank)
    if wrap == "ddp":
        model = DDP(model, comm)
    elif wrap == "fsdp":
        model = FSDP(model, comm, units=list(model.blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = batch(data, rows, cfg.block, step)
        mine = slice(r * rows // p, (r + 1) * rows // p)
        opt.zero_grad()
        loss = model(x[mine], y[mine])
        loss.backward()  # DDP and FSDP average the gradients in here
        opt.step()
        losses.append(loss.item())
    state = model.full_state_dict() if wrap == "fsdp" else (
        model.module if wrap == "ddp" else model).state_dict()
    torch.set_default_dtype(torch.float32)
    flat = torch.cat([v.detach().reshape(-1).double() for v in state.values()])
    return flat.numpy(), losses


def a_real_model(lab):
    _warm()
    import torch

    from dplab.lessons.chargpt import (
        VOCAB,
        CharGPT,
        GPTConfig,
        attention_flops_per_token,
        batch,
        encode,
        matmul_params,
        param_formula,
        text,
    )
    cfg = GPTConfig()
    model = CharGPT(cfg)
    x, y = batch(encode(text()), ROWS, cfg.block, 0)
    with torch.no_grad():
        first = model(x, y).item()
    n = matmul_params(model)
    return {"n_total": sum(t.numel() for t in model.parameters()),
            "formula": param_formula(cfg), "n_matmul": n,
            "flops_per_token": 6 * n,
            "attn_share": attention_flops_per_token(cfg) / (6 * n),
            "layers": cfg.layers, "d": cfg.d, "block": cfg.block,
            "vocab": len(VOCAB), "chars": len(text()),
            "first_loss": first, "uniform": math.log(len(VOCAB)),
            "sample": text()[:60].replace("\n", " ")}


def same_as_one_process(lab):
    _warm()
    steps = 2
    alone, alone_losses = lab.world(1).run(train, "none", steps)[0]
    world = lab.world(2, "torch")
    out = {"steps": steps, "rows": ROWS, "first": alone_losses[0], "last": alone_losses[-1]}
    scale = float(np.abs(alone).max())
    for wrap in ("ddp", "fsdp"):
        ranks = world.run(train, wrap, steps)
        out[f"{wrap}_same"] = all(np.array_equal(r[0], ranks[0][0]) for r in ranks)
        out[wrap] = float(np.abs(ranks[0][0] - alone).max()) / scale
    return out


def throughput(comm, wrap, steps_per_repeat, repeats, rows):
    """This rank's matmul peak and seconds per step of each repeat, by the wall clock and by this
    thread's CPU time (which other programs on a shared core cannot inflate), float32."""
    import torch

    from dplab.backends.nn.ddp import DDP
    from dplab.lessons.chargpt import CharGPT, GPTConfig, batch, encode, text
    torch.set_num_threads(1)
    peak, peak_cpu = peak_flops(), peak_flops(clock=time.thread_time)
    cfg, data = GPTConfig(), encode(text())
    model = CharGPT(cfg)
    p, r = (1, 0) if wrap == "none" else (comm.world_size, comm.rank)
    if wrap == "ddp":
        model = DDP(model, comm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times, cpu = [], []
    for k in range(1 + repeats):       # the first repeat warms up and is not kept
        t0, c0 = time.perf_counter(), time.thread_time()
        for step in range(steps_per_repeat):
            x, y = batch(data, rows, cfg.block, step)
            mine = slice(r * rows // p, (r + 1) * rows // p)
            opt.zero_grad()
            model(x[mine], y[mine]).backward()
            opt.step()
        if k:
            times.append((time.perf_counter() - t0) / steps_per_repeat)
            cpu.append((time.thread_time() - c0) / steps_per_repeat)
    return peak, times, peak_cpu, cpu


@functools.lru_cache(maxsize=2)
def on_h100s(cluster=H100, rows=H100_ROWS):
    """Lesson 14's GPT at GPT-2 small's size, bfloat16, a DDP step
    on every GPU of a simulated node and on one: each aten operation
    priced from a run on meta tensors (lessons/priced.py)."""
    from dplab.backends.sim.timing import ddp_step_time
    from dplab.lessons import priced
    from dplab.reference.cluster import cluster as named
    c = named(cluster)
    units = priced.price_units(priced.GPT2_SMALL, rows)
    layers = priced.ddp_layers(units, cluster)
    opt_s = units.optimizer_s(cluster)
    step = {p: ddp_step_time(cluster, p, layers, 25.0, "ring", 2,
                             opt_s).seconds for p in (1, c.size)}
    p, peak = c.size, c.device.rate("bfloat16")
    tps = p * rows * priced.GPT2_SMALL.block / step[p]
    return {"p": p, "step": step, "tps": tps, "peak": peak,
            "n": units.n_matmul, "mfu": 6 * units.n_matmul * tps / (p * peak),
            "split": priced.op_split(units.ops(), cluster), "units": units,
            "device": c.device.name, "cluster": c.name}


def tokens_and_mfu(lab):
    _warm()
    block = 32
    out = {"repeats": REPEATS, "n": N_MATMUL}
    core = None                          # one core's peak, measured by the process alone: both divide by it
    for p, wrap, world in ((1, "none", lab.world(1)), (2, "ddp", lab.world(2, "torch"))):
        ranks = world.run(throughput, wrap, STEPS_PER_REPEAT, REPEATS, ROWS)
        peak = min(r[0] for r in ranks)             # each rank's own, the slower one
        core = core or peak
        step_s = [max(r[1][k] for r in ranks) for k in range(REPEATS)]  # a step ends on its last rank
        tps = [ROWS * block / s for s in step_s]
        mfu = [6 * N_MATMUL * t / (p * core) for t in tps]
        # the same ratio by CPU time, per rank: FLOPs done over what the core could do in that time
        mfu_cpu = [6 * N_MATMUL * (ROWS // p) * block / (c * r[2]) for r in ranks for c in r[3]]
        out[p] = {"peak": peak, "tps": tps, "mfu": mfu, "mfu_cpu": mfu_cpu}
    one, two = out[1], out[2]
    out["peak_gflops"] = one["peak"] / 1e9
    out["flops"] = 6 * N_MATMUL
    out["ideal_tps"] = one["peak"] / (6 * N_MATMUL)
    out["tps1"] = statistics.median(one["tps"])
    out["mfu1"] = 100 * statistics.median(one["mfu"])
    out["mfu1_lo"], out["mfu1_hi"] = 100 * min(one["mfu"]), 100 * max(one["mfu"])
    out["tps2"] = statistics.median(two["tps"])
    out["mfu2"] = 100 * statistics.median(two["mfu"])
    out["mfu2_lo"], out["mfu2_hi"] = 100 * min(two["mfu"]), 100 * max(two["mfu"])
    out["speedups"] = ", ".join(f"{b / a:.2f}x" for a, b in zip(one["tps"], two["tps"]))
    every = one["mfu_cpu"] + two["mfu_cpu"]
    out["cpu_lo"], out["cpu_hi"] = 100 * min(every), 100 * max(every)
    out["load"] = os.getloadavg()[0]
    out["two_word"] = two_word(one["tps"], two["tps"])
    out["tokens_here"] = ROWS * block
    return out | simulated_mfu()


def two_word(one, two):
    """Two ranks against one over paired repeats, in words: an order only
    when every repeat agrees."""
    ratios = [b / a for a, b in zip(one, two)]
    if max(ratios) < 1:
        return "slower"
    if min(ratios) > 1:
        return "faster"
    return "faster in some repeats and slower in others"


def simulated_mfu():
    """14.3's numbers on the simulated H100s, as the text reads them."""
    from dplab.lessons.chargpt import attention_flops_per_token
    sim = on_h100s()
    units, split = sim["units"], sim["split"]
    cfg, total = units.cfg, sum(sim["split"].values())
    return {"h100_p": sim["p"], "h100_device": sim["device"], "h100_cluster": sim["cluster"],
            "h100_rows": units.rows, "h100_block": cfg.block, "h100_layers": cfg.layers,
            "h100_d": cfg.d, "h100_heads": cfg.heads, "h100_n": sim["n"], "h100_tflops": sim["peak"] / 1e12,
            "h100_ideal_tps": sim["peak"] / (6 * sim["n"]),
            "h100_step_ms": 1e3 * sim["step"][sim["p"]], "h100_tps": sim["tps"],
            "h100_mfu": 100 * sim["mfu"],
            # Chowdhery et al. count attention's products too: 6 N + 12 L H Q T a token
            "h100_attn_pct": 100 * attention_flops_per_token(cfg) / (6 * sim["n"]),
            "h100_mfu_attn": 100 * sim["mfu"] * (1 + attention_flops_per_token(cfg) / (6 * sim["n"])),
            "h100_matmul_pct": 100 * split["matmul"] / total,
            "h100_memory_pct": 100 * split["memory"] / total,
            "h100_launch_pct": 100 * split["launch"] / total,
            "h100_score_pct": 100 * score_memory_share(sim),
            "h100_ddp_pct": 100 * (sim["step"][sim["p"]] / sim["step"][1] - 1)}


def score_memory_share(sim):
    """The share of the memory-bound operations' time spent on the attention's score matrix:
    operations that move at least its rows x heads x block x block numbers."""
    from dplab.lessons.priced import op_split
    units, cfg = sim["units"], sim["units"].cfg
    itemsize = 2 if units.dtype in ("bfloat16", "float16") else 4
    score = units.rows * cfg.heads * cfg.block ** 2 * itemsize
    big = op_split([o for o in units.ops() if o.nbytes >= score], sim["cluster"])["memory"]
    return big / sim["split"]["memory"]


def profile(comm, wrap, steps, rows):
    """Trace ``steps`` float32 steps: forward, backward and optimizer spans
    beside the collectives' own events (sends, buckets, gathers).
    ``wrap``: "ddp", "fsdp" or "none" (one process, every row)."""
    import torch

    from dplab.backends.nn.ddp import DDP
    from dplab.backends.nn.fsdp import FSDP
    from dplab.lessons.chargpt import CharGPT, GPTConfig, batch, encode, text
    torch.set_num_threads(1)
    cfg, data = GPTConfig(), encode(text())
    model = CharGPT(cfg)
    p, r = (1, 0) if wrap == "none" else (comm.world_size, comm.rank)
    if wrap == "ddp":
        model = DDP(model, comm)
    elif wrap == "fsdp":
        model = FSDP(model, comm, units=list(model.blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tr, cpu = comm.tracer, []
    for step in range(steps):
        tr.enabled = step > 0          # the first step warms up
        x, y = batch(data, rows, cfg.block, step)
        mine = slice(r * rows // p, (r + 1) * rows // p)
        opt.zero_grad()
        c0 = time.thread_time_ns()     # CPU time: what other programs
        with tr.span("forward", extra={"step": step}):
            loss = model(x[mine], y[mine])
        c1 = time.thread_time_ns()     # on the core cannot inflate
        with tr.span("backward", extra={"step": step}):
            loss.backward()  # DDP's wait for the last bucket is in here
        if step:
            cpu.append((c1 - c0, time.thread_time_ns() - c1))
        with tr.span("optimizer", extra={"step": step}):
            opt.step()
    tr.enabled = False
    return [(e.kind, e.t_start_ns, e.t_end_ns, e.bytes, e.thread)
            for e in tr.take()], cpu


def per_step_sum(events, kind, steps):
    """ms a step spent in ``kind`` spans (events in step order)."""
    spans = [(b - a) / 1e6 for k, a, b, _, _ in events if k == kind]
    per = len(spans) // steps
    return [sum(spans[i * per:(i + 1) * per]) for i in range(steps)]


def hidden_under_backward(events):
    """ms the comm thread spent on buckets before backward ended (before
    the step's wait began), step by step."""
    waits = [t0 for k, t0, _, _, _ in events if k == "wait"]
    spans = [(a, b) for k, a, b, _, _ in events if k == "bucket"]
    if not waits:                      # FSDP: no buckets to wait for
        return []
    per = len(spans) // len(waits)
    return [sum(max(0, min(b, t0) - a) for a, b in spans[i * per:(i + 1) * per]) / 1e6
            for i, t0 in enumerate(waits)]


def split_wait(ranks):
    """Rank 0's wait at the end of backward, per step, cut in two: the
    other rank still computing (its own wait began later), then the
    all-reduce both ranks were waiting on (ms; the ranks share a clock)."""
    starts = [[t0 for k, t0, _, _, _ in ev if k == "wait"] for ev, _ in ranks]
    mine = [(t0, t1) for k, t0, t1, _, _ in ranks[0][0] if k == "wait"]
    lag = [min(max(max(s[i] for s in starts) - t0, 0), t1 - t0) / 1e6
           for i, (t0, t1) in enumerate(mine)]
    return lag, [(t1 - t0) / 1e6 - g for (t0, t1), g in zip(mine, lag)]


def where_time_goes(lab):
    _warm()
    steps = 6
    world = lab.world(2, "torch")
    out = {"steps": steps - 1}
    for wrap in ("ddp", "fsdp"):
        ranks = world.run(profile, wrap, steps, ROWS)
        events, cpu = ranks[0]

        def per_step(kind, events=events):
            return [(b - a) / 1e6 for k, a, b, _, _ in events if k == kind]

        fwd, bwd, opt, wait = (per_step(k) for k in ("forward", "backward", "optimizer", "wait"))
        sent = sum(b for k, _, _, b, _ in events if k == "send") // (steps - 1)
        lag, exposed = split_wait(ranks) if wait else ([0.0], [0.0])
        comm, hidden = per_step_sum(events, "bucket", steps - 1), hidden_under_backward(events)
        # the wait's parts from one step, the median one, so that they add up
        m = sorted(range(len(wait)), key=wait.__getitem__)[len(wait) // 2] if wait else 0
        out[wrap] = {"forward": statistics.median(fwd), "backward": statistics.median(bwd),
                     "optimizer": statistics.median(opt),
                     "wait": statistics.median(wait) if wait else 0.0,
                     "lag": lag[m], "exposed": exposed[m], "comm": comm[m],
                     "hidden": hidden[m] if hidden else 0.0,
                     "lag_all": lag, "exposed_all": exposed, "wait_all": wait,
                     "buckets": sum(k == "bucket" for k, *_ in events) // (steps - 1),
                     # backward's own compute: its span less the wait for the last bucket inside it
                     "bwd_over_fwd": [(b - w) / f for f, b, w in zip(fwd, bwd, wait or [0.0] * len(bwd))],
                     "cpu_ratio": sum(b for _, b in cpu) / sum(f for f, _ in cpu), "sent": sent}
    ddp, fsdp = out["ddp"], out["fsdp"]
    total = ddp["forward"] + ddp["backward"] + ddp["optimizer"]
    out.update({"fwd_ms": ddp["forward"], "bwd_ms": ddp["backward"] - ddp["wait"],
                "wait_ms": ddp["wait"], "opt_ms": ddp["optimizer"], "comm_ms": ddp["comm"],
                "lag_ms": ddp["lag"], "exposed_ms": ddp["exposed"],
                "hidden_ms": ddp["hidden"], "buckets": ddp["buckets"],
                "step_wait_ms": ddp["lag"] + ddp["exposed"],
                "wait_parts": list(zip(ddp["wait_all"], ddp["lag_all"], ddp["exposed_all"])),
                "fwd_pct": 100 * ddp["forward"] / total,
                "bwd_pct": 100 * (ddp["backward"] - ddp["wait"]) / total,
                "wait_pct": 100 * ddp["wait"] / total, "opt_pct": 100 * ddp["optimizer"] / total,
                "ratios": ", ".join(f"{x:.2f}" for x in ddp["bwd_over_fwd"]), "cpu_ratio": ddp["cpu_ratio"],
                "ddp_sent": ddp["sent"], "fsdp_sent": fsdp["sent"],
                "grad_bytes": 4 * 344_544, "fsdp_over_ddp": fsdp["sent"] / ddp["sent"],
                "fsdp_fwd_ms": fsdp["forward"], "fsdp_bwd_ms": fsdp["backward"]})
    return out | against_one_process(lab, steps, ddp) | simulated_split()


def against_one_process(lab, steps, ddp):
    """DDP's step on 2 ranks against one process's on the whole batch, measured here, and the
    difference cut into the wait, the compute that did not halve and the optimizer."""
    events, _ = lab.world(1).run(profile, "none", steps, ROWS)[0]
    one = {k: statistics.median((b - a) / 1e6 for k2, a, b, _, _ in events if k2 == k)
           for k in ("forward", "backward", "optimizer")}
    one_ms, ddp_ms = sum(one.values()), ddp["forward"] + ddp["backward"] + ddp["optimizer"]
    compute = ddp["forward"] + ddp["backward"] - ddp["wait"] - one["forward"] - one["backward"]
    return {"one_ms": one_ms, "ddp_ms": ddp_ms, "ddp_vs_one": ddp_ms / one_ms,
            "ddp_word": "slower" if ddp_ms > one_ms else "faster",
            "diff_ms": ddp_ms - one_ms, "extra_wait_ms": ddp["wait"], "extra_compute_ms": compute,
            "extra_opt_ms": ddp["optimizer"] - one["optimizer"],
            "half_pct": 100 * (ddp["forward"] + ddp["backward"] - ddp["wait"])
            / (one["forward"] + one["backward"]),
            "load_now": os.getloadavg()[0], "rows_per_rank": ROWS // 2 * BLOCK}


def simulated_split():
    """Step 3's DDP step on the simulated H100s, split as the trace splits this machine's."""
    from dplab.backends.sim.timing import collective_time
    from dplab.lessons.priced import ddp_layers
    sim = on_h100s()
    layers, units, p = ddp_layers(sim["units"], sim["cluster"]), sim["units"], sim["p"]
    fwd, bwd = sum(f for _, f, _ in layers), sum(b for _, _, b in layers)
    opt = units.optimizer_s(sim["cluster"])
    grad = 2 * sum(n for n, _, _ in layers)  # bfloat16 gradients
    ring = collective_time(sim["cluster"], p, "ring", grad, 2).seconds
    exposed = sim["step"][p] - (fwd + bwd + opt)
    return {"sim_fwd_ms": 1e3 * fwd, "sim_bwd_ms": 1e3 * bwd, "sim_opt_ms": 1e3 * opt,
            "sim_step_ms": 1e3 * sim["step"][p], "sim_exposed_ms": 1e3 * exposed,
            "sim_ring_ms": 1e3 * ring, "sim_grad_bytes": grad, "sim_bwd_over_fwd": bwd / fwd,
            "sim_hidden_pct": 100 * (1 - exposed / ring)}


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")  # what a matmul runs as


def profiled_step(comm, out_dir):
    """One float32 step (after a warm-up) under torch.profiler and
    dplab's tracer; both traces written as Chrome traces to out_dir."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dplab.lessons.chargpt import CharGPT, GPTConfig, batch, encode, text
    from dplab.reference.trace import Tracer, to_chrome
    torch.set_num_threads(1)
    cfg, data = GPTConfig(), encode(text())
    model = CharGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tr = Tracer(0)
    for step in range(2):              # step 0 warms up
        x, y = batch(data, ROWS, cfg.block, step)
        tr.enabled = step == 1
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("forward"), tr.span("forward"):
                loss = model(x, y)
            with record_function("backward"), tr.span("backward"):
                loss.backward()
            with record_function("optimizer"), tr.span("optimizer"):
                opt.step()
        opt.zero_grad()
    prof.export_chrome_trace(f"{out_dir}/torch_profile.json")
    with open(f"{out_dir}/dplab_trace.json", "w") as f:
        json.dump(to_chrome(tr.take()), f)
    events = prof.events()
    spans = {e.name: e.time_range for e in events
             if e.name in ("forward", "backward", "optimizer")}
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    top = [(a.key, a.self_cpu_time_total / 1e3, a.count) for a in top[:5]]
    return {phase: sum(e.name in MATMULS and r.start <= e.time_range.start
                       <= r.end for e in events)
            for phase, r in spans.items()} | {
        "ops": sum(e.name.startswith("aten::") for e in events),
        "top": top}


def a_profile(lab):
    import json
    from pathlib import Path
    out_dir = str(lab._path().parent)   # the lab's own folder, gone when it closes
    counts = lab.world(1).run(profiled_step, out_dir)[0]
    torch_doc = json.loads((Path(out_dir) / "torch_profile.json").read_text())
    ours = json.loads((Path(out_dir) / "dplab_trace.json").read_text())
    spans = [e for e in ours["traceEvents"] if e.get("ph") == "X"]
    return {"fwd_mm": counts["forward"], "bwd_mm": counts["backward"],
            "opt_mm": counts["optimizer"], "ops": counts["ops"],
            "torch_events": len(torch_doc["traceEvents"]),
            "dplab_spans": len(spans),
            "span_names": ", ".join(e["name"] for e in spans),
            "top": "\n".join(f"| {k} | {ms:.3g} | {n} |"
                              for k, ms, n in counts["top"]),
            "dir": out_dir}


def _why_no_gpu():
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False)"
    return ""


def on_a_gpu(lab):
    import torch
    why = _why_no_gpu()
    if why:
        return {"ran": False, "why": why, "said": f"Skipped: {why}.",
                "mfu_gpu": 0.0}
    from dplab.lessons.chargpt import CharGPT, GPTConfig, batch, encode, text
    peak = peak_flops("cuda", n=4096, reps=5)
    cfg, data = GPTConfig(), encode(text()).cuda()
    model = CharGPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows, times = GPU_ROWS, []
    for step in range(6):
        x, y = batch(data, rows, cfg.block, step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tps = rows * cfg.block / statistics.median(times[1:])
    mfu = 6 * N_MATMUL * tps / peak
    said = (f"Ran on {torch.cuda.get_device_name()}: {tps:,.0f} tokens/s "
            f"at {rows} rows, {100 * mfu:.2g}% of its own float32 "
            f"4096 × 4096 matmul ({peak / 1e12:.3g} TFLOP/s, measured): "
            "a model this small cannot fill a GPU; launch overheads "
            "dominate.")
    return {"ran": True, "why": "", "said": said, "mfu_gpu": mfu}


STEPS = (
    Step(
        title="A real model: a character-level GPT",
        text=("The model is a small GPT ({layers} blocks of attention and MLP, width {d}, context {block} "
              "characters) that reads a text this package generates from a seeded grammar ({chars:,} "
              "characters, {vocab} different ones: \"{sample}...\"). It has {n_total:,} parameters, "
              "exactly what counting by hand gives ({formula:,}); {n_matmul:,} of them sit in matmuls "
              "(the embeddings are lookups).\n\n"
              "A matmul with a weight of N numbers costs 2 N FLOPs per token forward (a multiply and an "
              "add), and backward costs twice that (the gradient with respect to the input and to the "
              "weight). So a token of training costs **6 N = {flops_per_token:,} FLOPs**. Attention's "
              "two products (queries with keys, the weights with the values: 12·L·d·T a token over the "
              "full T × T square this plain attention computes) add {attn_share:.1%} on top, which 6 N "
              "ignores; they grow with the context T (step 3). Untrained, the model guesses every "
              "character about equally: its first loss is {first_loss:.3f}, against ln({vocab}) = "
              "{uniform:.3f} for a uniform guess."),
        run=a_real_model,
        inputs={"n_matmul": N_MATMUL},
        checks=(Check("torch counts the parameters the hand formula gives ({n_total:,})",
                      lambda f: f["n_total"] == f["formula"]),
                Check("the matmul parameters are the {n_matmul:,} this lesson uses for 6 N",
                      lambda f: f["n_matmul"] == N_MATMUL),
                Check("attention's own FLOPs, 12·L·d·T a token, are under 10% of 6 N at this context",
                      lambda f: math.isclose(f["attn_share"] * 6 * f["n_matmul"],
                                             12 * f["layers"] * f["d"] * f["block"])
                      and f["attn_share"] < 0.10),
                Check("the untrained loss is within 10% of ln(vocab)",
                      lambda f: abs(f["first_loss"] - f["uniform"]) < 0.1 * f["uniform"])),
        predict=Predict("The model has N = {n_matmul:,} parameters in matmuls. How many FLOPs does one token "
                        "of training (forward and backward) cost?", "flops_per_token", rel_tol=0.02,
                        unit="FLOPs",
                        misconceptions=((lambda g, f: math.isclose(g, 2 * f["n_matmul"], rel_tol=0.02),
                                         "2 N is the forward pass alone; backward costs twice as much"),
                                        (lambda g, f: math.isclose(g, 4 * f["n_matmul"], rel_tol=0.02),
                                         "4 N is backward alone; add the forward's 2 N"),
                                        (lambda g, f: math.isclose(g, f["n_matmul"], rel_tol=0.02),
                                         "a multiply-add is 2 FLOPs, and there are three passes' worth"))),
        hint="A matmul of an input row with a weight of N numbers: N multiplies and N adds.",
        hints=("Backward computes two matmuls per weight: one for the input's gradient, one for the "
               "weight's.",),
        try_this="python -c 'from dplab.lessons.chargpt import text; print(text()[:300])'",
        show=("dplab.lessons.chargpt.Block", "dplab.lessons.chargpt.param_formula"),
        teaches=("real-model",),
    ),
    Step(
        title="DDP and FSDP train it as one process does",
        text=("Two ranks, forked, talk over torch.distributed's gloo backend. Each takes half of every "
              "global batch ({rows} windows), and the model trains {steps} AdamW steps wrapped in dplab's "
              "DDP (gradients all-reduced in buckets during backward) and again in its FSDP (each block's "
              "weights sharded, gathered only while it runs). In float64 both end within "
              "{ddp:.1e} (DDP) and {fsdp:.1e} (FSDP) of one process on the whole batch, relative to the "
              "largest weight, and the loss fell from {first:.3f} to {last:.3f}. The wrappers change "
              "where the numbers live and when they move, not what is computed."),
        run=same_as_one_process,
        checks=(Check("DDP equals one process (relative 1e-10, float64)", lambda f: f["ddp"] < 1e-10),
                Check("FSDP equals one process (relative 1e-10, float64)", lambda f: f["fsdp"] < 1e-10),
                Check("every rank ends with the same bits", lambda f: f["ddp_same"] and f["fsdp_same"]),
                Check("the loss fell", lambda f: f["last"] < f["first"])),
        hint="Each rank's loss is the mean over its half; averaging two halves' gradients is the mean "
             "over the whole batch.",
        try_this="dplab lesson 10   # what FSDP saves in memory, and what it costs in bytes",
        show=(train,),
        teaches=("real-model",),
    ),
    Step(
        title="Tokens per second on simulated H100s, and against this core's own matmul",
        text=("How good is a training speed? **Model FLOPs utilisation** (MFU, Chowdhery et al. 2022) "
              "divides the FLOPs the model needs per token by the hardware's rated peak: 6 N here, to "
              "which Chowdhery et al. add attention's products, 12·L·d·T a token (step 1). A GPU has "
              "one on its datasheet; this machine's cores do not, so first a simulated cluster, then "
              "this machine.\n\n"
              "**On {h100_p} simulated H100s** (`{h100_cluster}`: {h100_device}, {h100_tflops:.1f} "
              "TFLOP/s in bfloat16 each, NVLink between them). The same model at GPT-2 small's size "
              "({h100_layers} blocks, width {h100_d}, {h100_block:,} characters of context: N = "
              "{h100_n:,}) trains with DDP in bfloat16, {h100_rows} windows per GPU. The sim backend "
              "takes every operation of a step from a run on meta tensors (shapes without data) and "
              "prices it at its roofline on the device: its FLOPs at the rated peak or its bytes at the "
              "memory bandwidth, whichever is slower. A step takes {h100_step_ms:.3g} ms: "
              "{h100_tps:,.0f} tokens/s, an MFU of **{h100_mfu:.2g}%** by 6 N ({h100_mfu_attn:.2g}% "
              "counting attention as Chowdhery et al. do: at a context of {h100_block:,} it adds "
              "{h100_attn_pct:.0f}% to 6 N). Of the operations' time, "
              "{h100_matmul_pct:.0f}% goes to those bound by their FLOPs (the weights' matmuls) and "
              "{h100_memory_pct:.0f}% to those bound by memory bandwidth, {h100_score_pct:.0f}% of it on "
              "the attention's score matrix ({h100_rows} × {h100_heads} heads × {h100_block:,} × "
              "{h100_block:,} "
              "numbers, written and read again by the product of queries and keys, the mask, the "
              "softmax and their backward). FlashAttention fuses those operations so that the matrix "
              "never leaves the chip; this model's attention is written out plainly, and pays for it. "
              "DDP costs little here: the step on {h100_p} GPUs is {h100_ddp_pct:.2g}% longer than on "
              "one, its all-reduces on NVLink hidden behind backward (lesson 4).\n\n"
              "**On this machine** (measured, load {load:.1f} on two cores shared with other work). "
              "With no rated peak, this divides by something humbler, and names it so: **matmul "
              "utilisation**, against this core's own best float32 matmul of 384 × 384 on one thread "
              "(the best of 5), {peak_gflops:.3g} GFLOP/s here, so at most {ideal_tps:,.0f} tokens/s "
              "per core. Timed {repeats} times (after a warm-up), one process trains {tps1:,.0f} "
              "tokens/s, **{mfu1:.2g}% of that matmul** ({mfu1_lo:.2g}% to {mfu1_hi:.2g}% over the "
              "repeats); DDP on 2 ranks {tps2:,.0f} tokens/s, {mfu2:.2g}% of two cores' matmul "
              "({mfu2_lo:.2g}-{mfu2_hi:.2g}%), speed-ups repeat by repeat {speedups}: two ranks were "
              "{two_word} than one here (step 4 says why). Timed by each rank's CPU time instead (the "
              "core's time it really had), it is {cpu_lo:.2g}-{cpu_hi:.2g}%. These numbers differ from "
              "the H100's for reasons of this machine, not of the model: a peak measured rather than "
              "rated, a step of {tokens_here} tokens too small to keep a core busy, two ranks on two "
              "cores that "
              "other programs share, and the load of the moment. What holds on both is the shape: a "
              "step stays well below the rate of its matmuls, because the operations that do no model "
              "FLOPs (attention's softmax, LayerNorm, the optimizer) take time too."),
        run=tokens_and_mfu,
        checks=(Check("simulated: MFU is 6 N × tokens/s over the {h100_p} GPUs' rated peak, below 100%",
                      lambda f: 0 < f["h100_mfu"] < 100 and math.isclose(
                          f["h100_mfu"], 100 * 6 * f["h100_n"] * f["h100_tps"]
                          / (f["h100_p"] * f["h100_tflops"] * 1e12), rel_tol=1e-9)),
                Check("simulated: counting attention's 12·L·d·T a token raises the MFU by that share of 6 N",
                      lambda f: math.isclose(f["h100_mfu_attn"], f["h100_mfu"] * (
                          1 + 12 * f["h100_layers"] * f["h100_d"] * f["h100_block"] / (6 * f["h100_n"])),
                          rel_tol=1e-9)),
                Check("simulated: memory-bound operations take more of the step than the matmuls, "
                      "most of it on the score matrix",
                      lambda f: f["h100_memory_pct"] > f["h100_matmul_pct"] and f["h100_score_pct"] > 50),
                Check("simulated: DDP on {h100_p} GPUs adds under 2% to one GPU's step",
                      lambda f: 0 <= f["h100_ddp_pct"] < 2),
                Check("this machine: matmul utilisation by CPU time, which other programs cannot inflate, "
                      "is below 100% in every repeat, on 1 and on 2 ranks",
                      lambda f: all(0 < m < 1 for p in (1, 2) for m in f[p]["mfu_cpu"])),
                Check("this machine: each utilisation is the tokens/s over p times the {ideal_tps:,.0f} "
                      "tokens/s one core's matmul allows",
                      lambda f: math.isclose(f["mfu1"], 100 * f["tps1"] / f["ideal_tps"], rel_tol=1e-9)
                      and math.isclose(f["mfu2"], 100 * f["tps2"] / (2 * f["ideal_tps"]), rel_tol=1e-9)),
                Check("this machine: the text's word for two ranks against one is the repeats' own",
                      lambda f: f["two_word"] == two_word(f[1]["tps"], f[2]["tps"]))),
        predict=Predict("An H100 is rated at {h100_tflops:.1f} TFLOP/s in bfloat16. At 6 N FLOPs a token, "
                        "N = {h100_n:,}, how many tokens/s could one H100 train at most?",
                        "h100_ideal_tps", rel_tol=0.05, unit="tokens/s",
                        misconceptions=((lambda g, f: math.isclose(g, 3 * f["h100_ideal_tps"], rel_tol=0.05),
                                         "that is the forward pass alone (2 N a token)"),
                                        (lambda g, f: math.isclose(g, 6 * f["h100_ideal_tps"], rel_tol=0.05),
                                         "divide by 6 N FLOPs a token, not by N"))),
        hint="Peak FLOP/s divided by FLOPs per token.",
        hints=("989.4 TFLOP/s is 989.4e12 FLOP/s; a token costs 6 N.",),
        try_this="dplab bench --backend sim --cluster dgx-h100 --world-size 8   # the all-reduce",
        show=(on_h100s, peak_flops),
        teaches=("real-model",),
    ),
    Step(
        title="Where the step time goes: forward, backward, the all-reduce",
        text=("dplab's tracer times every span of rank 0 over {steps} DDP steps (medians): forward "
              "{fwd_ms:.3g} ms ({fwd_pct:.0f}%), backward {bwd_ms:.3g} ms ({bwd_pct:.0f}%), waiting at "
              "the end of backward for the last bucket's all-reduce {wait_ms:.2g} ms ({wait_pct:.0f}%), "
              "the optimizer {opt_ms:.3g} ms ({opt_pct:.0f}%). Backward (less the wait) over forward, step "
              "by step: {ratios}; by the CPU time the rank's thread really ran, {cpu_ratio:.2f}x. Backward "
              "does twice forward's matmul FLOPs; the rest of the step (the loss, softmax, LayerNorm, "
              "Python) costs it less than that. "
              "DDP's 25 MiB bucket cap holds all {grad_bytes:size} of gradients in one bucket here, so "
              "its all-reduce can start only as backward ends (lesson 4 shows smaller buckets "
              "overlapping).\n\n"
              "The wait is not all all-reduce. Both ranks stamp the same clock, so the median step's "
              "wait of {step_wait_ms:.2g} ms splits in two: for {lag_ms:.2g} ms rank 1 was still in its "
              "own backward (the other rank's lag), and for {exposed_ms:.2g} ms both ranks waited on the "
              "last all-reduce, the communication backward did not hide. In that step the bucket's "
              "all-reduce took {comm_ms:.3g} ms on the comm thread (its wait for rank 1 included), "
              "{hidden_ms:.2g} ms of it before backward ended. Only the second part of the wait shrinks "
              "with a faster network; the first shrinks when the ranks' work is even (lesson 8).\n\n"
              "Bytes are not timings: they are exact. DDP's ring all-reduce sends {ddp_sent:size} a step "
              "from rank 0 (the {grad_bytes:size} of float32 gradients, as 2(p-1)/p says at p = 2). "
              "FSDP sends {fsdp_sent:size}: {fsdp_over_ddp:.2f}x, for gathering each block's weights "
              "before forward and again before backward, then reduce-scattering its gradient.\n\n"
              "**On the simulated H100s** (step 3's run, simulated time): forward {sim_fwd_ms:.3g} ms, "
              "backward {sim_bwd_ms:.3g} ms ({sim_bwd_over_fwd:.2f}x forward), the fused optimizer "
              "{sim_opt_ms:.2g} ms. The ring all-reduce of the {sim_grad_bytes:size} of bfloat16 "
              "gradients takes {sim_ring_ms:.2g} ms on its own; launched bucket by bucket during "
              "backward, it leaves {sim_exposed_ms:.2g} ms exposed ({sim_hidden_pct:.0f}% hidden).\n\n"
              "**DDP against one process, on this machine** (measured, load {load_now:.1f} on two "
              "cores): one process on the whole batch takes {one_ms:.3g} ms a step, DDP's rank 0 "
              "{ddp_ms:.3g} ms, {ddp_vs_one:.2f}x: {ddp_word}. The difference of {diff_ms:.2g} ms is "
              "the wait ({extra_wait_ms:.2g} ms, which one process never has), plus forward and "
              "backward on half the batch ({extra_compute_ms:+.2g} ms: {rows_per_rank} tokens a "
              "rank took {half_pct:.0f}% of one process's time on the whole batch, where half the work "
              "would take 50%), plus the optimizer ({extra_opt_ms:+.2g} ms: every rank steps every "
              "weight, as one process does, the same work, so what differs there is the load's noise). "
              "On the H100s each rank has a device of its own and the "
              "all-reduce has NVLink; here two ranks share two cores with other programs, the "
              "all-reduce runs on the same cores as the compute, and the optimizer does not shrink "
              "with the ranks."),
        run=where_time_goes,
        checks=(Check("by CPU time, backward cost more than forward ({cpu_ratio:.2f}x over {steps} steps)",
                      lambda f: f["cpu_ratio"] > 1),
                Check("one bucket holds the whole gradient", lambda f: f["buckets"] == 1),
                Check("every step's wait is the other rank's lag plus the last all-reduce, neither negative",
                      lambda f: all(lag >= 0 and rest >= 0 and abs(lag + rest - w) < 1e-9
                                    for w, lag, rest in f["wait_parts"])),
                Check("DDP's ring sends exactly the gradient's bytes at p = 2",
                      lambda f: f["ddp_sent"] == f["grad_bytes"]),
                Check("FSDP sends more than DDP and at most 1.5x",
                      lambda f: 1 < f["fsdp_over_ddp"] <= 1.5 + 1e-9),
                Check("simulated: backward takes longer than forward, and the buckets hide part of the "
                      "all-reduce behind it",
                      lambda f: f["sim_bwd_ms"] > f["sim_fwd_ms"]
                      and 0 <= f["sim_exposed_ms"] < f["sim_ring_ms"]),
                Check("this machine: DDP's step less one process's is the wait, the extra compute and "
                      "the extra optimizer time, and the word for it is the data's",
                      lambda f: abs(f["diff_ms"] - f["extra_wait_ms"] - f["extra_compute_ms"]
                                    - f["extra_opt_ms"]) < 1e-6
                      and f["ddp_word"] == ("slower" if f["ddp_ms"] > f["one_ms"] else "faster"))),
        hint="Backward does two matmuls for each of forward's one.",
        hints=("At p = 2 a ring all-reduce sends half the buffer in the reduce-scatter and half in the "
               "all-gather.",),
        try_this="dplab train --backend torch --world-size 2 --trace run.json   # open it in the app",
        show=(profile, split_wait),
        teaches=("real-model",),
    ),
    Step(
        title="On a GPU, when there is one",
        text=("The same model on a CUDA device, one process (dplab's torch backend puts one rank on each "
              "GPU: `DPLAB_DEVICE=cuda torchrun --nproc-per-node N ...` with N GPUs). {said}"),
        run=on_a_gpu,
        checks=(Check("it ran on the GPU below 100% of its own matmul's rate, or it says why not",
                      lambda f: (f["ran"] and 0 < f["mfu_gpu"] < 1) or (not f["ran"] and f["why"])),),
        hint=(f"A GPU's peak needs large matmuls: a step here is {GPU_ROWS} rows × {BLOCK} characters = "
              f"{GPU_ROWS * BLOCK:,} tokens, each a vector of width {WIDTH}; the weights it multiplies "
              f"are {WIDTH} × {4 * WIDTH} at most, small for a GPU."),
        try_this="dplab lesson 14 --step 5   # on a machine with a CUDA GPU",
        teaches=("real-model",),
    ),

    Step(
        title="A profile of one step: torch.profiler beside dplab's trace",
        text=("dplab's tracer records what data parallelism adds: spans of the step's phases and, "
              "on ranks, every message and bucket. What happens inside a phase is torch's to say: "
              "`torch.profiler` records every operation the step runs. One step of the model "
              "(after a warm-up), under both: the profiler saw {ops:,} aten operations, dplab's "
              "trace {dplab_spans} spans ({span_names}). Both are Chrome traces, written to {dir} "
              "while the lesson runs (torch_profile.json and dplab_trace.json: open either in "
              "ui.perfetto.dev; the forward, backward and optimizer labels line up).\n\nCounted "
              "from the profile, forward ran **{fwd_mm} matrix multiplies** (aten::mm, addmm and "
              "bmm: four linear layers and two attention products per block, and the head), "
              "backward **{bwd_mm}**, the optimizer {opt_mm}: every forward matmul has two in "
              "backward, one for the gradient of its input and one for that of its weight. That "
              "is 6 N counted in operations rather than FLOPs. The profile's own table, by the "
              "CPU time each operation took itself (this machine's, and it moves with the "
              "load):\n\n| operation | self CPU ms | calls |\n|---|---|---|\n{top}"),
        run=a_profile,
        checks=(Check("backward ran exactly twice forward's matrix multiplies",
                      lambda f: f["bwd_mm"] == 2 * f["fwd_mm"] > 0),
                Check("AdamW multiplies no matrices", lambda f: f["opt_mm"] == 0),
                Check("both traces are Chrome traces; dplab's has the three phases",
                      lambda f: f["torch_events"] > f["dplab_spans"] == 3)),
        predict=Predict("Forward ran {fwd_mm} matrix multiplies. How many does backward run?",
                        "bwd_mm", misconceptions=(
                            (lambda g, f: g == f["fwd_mm"],
                             "backward runs two for each of forward's: the input's gradient and "
                             "the weight's"),
                            (lambda g, f: g == 3 * f["fwd_mm"],
                             "6 N counts forward and backward together: backward alone is 4 N, two "
                             "per forward matmul"))),
        hint="For y = x W, backward needs dL/dx = dL/dy Wᵀ and dL/dW = xᵀ dL/dy.",
        try_this="python -c \"import torch; help(torch.profiler.profile)\"   # schedule=, "
                 "with_stack=",
        show=(profiled_step,),
        teaches=("real-model", "profiling"),
    ),)


LESSON = Lesson(14, "real_model", "A real model: a character-level GPT with DDP and FSDP",
                "What a transformer's training step costs in FLOPs and time, its MFU on simulated "
                "H100s and its matmul utilisation here, where the time goes, and a profile of one "
                "step.",
                STEPS, needs=("torch",))
