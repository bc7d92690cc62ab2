"""Lesson 15: the real PyTorch stack, and cutting communication.

    dplab lesson 15              # needs the torch extra: pip install -e ".[torch]"

Nine steps: DDP built from hooks on torch tensors (the exercise: a post-accumulate-grad hook per
parameter, an asynchronous all-reduce from each, a wait before the step); torch's
DistributedSampler (set_epoch, and the samples its padding repeats) against dplab's weighted
uneven shards; why per-rank BatchNorm statistics are not one device's, and what SyncBatchNorm
all-reduces instead; torch DDP's communication hooks that compress gradients (fp16, bf16,
PowerSGD) measured in bytes and loss on gloo; local SGD, which averages the weights every H
steps, in bytes and loss; then FSDP's overlap on a simulated DGX H100: prefetching the next unit's
gather, reshard_after_forward, HSDP on two nodes, and the exercise, a forward that prefetches.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from dplab.backends import launch
from dplab.backends.sim.timing import schedule_time
from dplab.lessons.exercises.ddp_hooks import HINTS as HOOK_HINTS
from dplab.lessons.exercises.fsdp_prefetch import HINTS as PREFETCH_HINTS
from dplab.lessons.l02_allreduce import rings_per_nic
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.columns import columns
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.schedule import Schedule
from dplab.reference.train.single import TrainConfig
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.train import train_zero

__all__ = ["LESSON"]

HOOK_TENSORS = 6     # the exercise's MLP: three Linear layers, a weight and a bias each


def _warm():
    """Import in this process what the ranks need before they fork from it: torch's DDP, like its
    first AdamW, pulls in some 800 modules (dynamo, sympy), seconds that each rank would pay again."""
    import torch
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


# --- 1. DDP from hooks --------------------------------------------------------------------------

def hooks_on_ranks(comm):
    """The exercise's shipped solution on this rank: its parameters after
    each step, and how many all-reduces each backward launched."""
    import torch
    import torch.distributed as dist

    from dplab.lessons.exercises import ddp_hooks as ex
    from dplab.lessons.exercises.solutions.ddp_hooks import attach_ddp_hooks
    torch.set_num_threads(1)
    model = ex.make_model()
    recorder = ex._Recorder(dist.all_reduce, list(model.parameters()))
    real, dist.all_reduce = dist.all_reduce, recorder.all_reduce
    try:
        finish = attach_ddp_hooks(model)
        p, r, after = comm.world_size, comm.rank, []
        for step in range(ex.STEPS):
            recorder.step = step
            x, y = ex.data(step)
            half = slice(r * ex.ROWS // p, (r + 1) * ex.ROWS // p)
            recorder.phase = "backward"
            torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
            recorder.phase = "finish"
            finish()
            ex.sgd_step(model)
            after.append(ex._flat(model))
    finally:
        dist.all_reduce = real
    launches = [e for e in recorder.log if e["event"] == "launch"]
    waits = [e for e in recorder.log if e["event"] == "wait"]
    return after, len(launches) // ex.STEPS, all(e["phase"] == "finish" for e in waits)


def ddp_from_hooks(lab):
    from dplab.lessons.exercises import ddp_hooks as ex
    _warm()
    oracle = ex.train_one_process()
    ranks = lab.world(2, "torch").run(hooks_on_ranks)
    scale = float(np.abs(oracle[-1]).max())
    diff = max(float(np.abs(a - b).max()) for after, _, _ in ranks for a, b in zip(after, oracle[1:]))
    return {"tensors": HOOK_TENSORS, "per_backward": ranks[0][1], "steps": ex.STEPS,
            "waited_in_finish": all(w for _, _, w in ranks), "diff": diff / scale}


# --- 2. DistributedSampler against weighted uneven shards ----------------------------------------

def sampler_against_shards(lab):
    import torch
    from torch.utils.data.distributed import DistributedSampler

    from dplab.reference.data import shard
    n, p = 10, 4
    data = list(range(n))

    def epoch(e, set_epoch, drop_last=False):
        out = []
        for r in range(p):
            s = DistributedSampler(data, num_replicas=p, rank=r, shuffle=True, seed=0, drop_last=drop_last)
            if set_epoch:
                s.set_epoch(e)
            out.append(list(s))
        return out

    e0, e1_forgot, e1 = epoch(0, True), epoch(1, False), epoch(1, True)
    handed = [i for rank in e0 for i in rank]
    repeated = sorted({i for i in handed if handed.count(i) > 1})
    dropped = sorted(set(data) - {i for rank in epoch(0, True, drop_last=True) for i in rank})
    # a linear model's squared loss: the gradient of the mean over the samples each scheme uses
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    per_sample = 2 * (x @ w - y)[:, None] * x            # each sample's own gradient
    full = per_sample.mean(0)
    padded = torch.stack([per_sample[rank].mean(0) for rank in e0]).mean(0)   # DDP: average of means
    every = np.arange(n)                                  # the same samples, each once
    shards = [torch.as_tensor(shard(every, r, p)) for r in range(p)]
    weighted = sum(len(s) / n * per_sample[s].mean(0) for s in shards)       # dplab: n_r / N each
    return {"n": n, "p": p, "handed": len(handed), "per_rank": len(e0[0]),
            "repeated": ", ".join(map(str, repeated)), "n_repeated": len(repeated),
            "dropped": ", ".join(map(str, dropped)), "n_dropped": len(dropped),
            "same_without_set_epoch": e1_forgot == e0, "differs_with_set_epoch": e1 != e0,
            "e0": str(e0[0]), "e1_forgot": str(e1_forgot[0]), "e1": str(e1[0]),
            "shard_sizes": ", ".join(str(len(s)) for s in shards),
            "padded_err": float((padded - full).norm() / full.norm()),
            "weighted_err": float((weighted - full).norm() / full.norm())}


# --- 3. BatchNorm's statistics per rank and synced -----------------------------------------------

HALVES = ((-4.0, -2.0, -1.0, -1.0), (1.0, 2.0, 3.0, 2.0))  # rank 0's and rank 1's samples (one feature)


def sync_batch_stats(comm, x):
    """SyncBatchNorm's statistics: every rank's sum, sum of squares and
    count, all-reduced, give the whole batch's mean and variance."""
    from dplab.backends import allreduce
    local = np.array([x.sum(), (x * x).sum(), len(x)], dtype=np.float64)
    total = allreduce(comm, local)             # [sum, sum of squares, n]
    mean = total[0] / total[2]
    return mean, total[1] / total[2] - mean * mean


def batchnorm_on_ranks(comm):
    import torch
    x = np.array(HALVES[comm.rank])
    bn = torch.nn.BatchNorm1d(1, affine=False).double()   # per rank: its own half's statistics
    per_rank = bn(torch.as_tensor(x)[:, None]).detach().numpy()[:, 0]
    mean, var = sync_batch_stats(comm, x)
    synced = (x - mean) / np.sqrt(var + bn.eps)
    try:                                                   # torch's own, where it runs
        torch.nn.SyncBatchNorm(1)(torch.as_tensor(x)[:, None].float())
        torch_says = "ran"
    except (ValueError, RuntimeError) as e:
        torch_says = str(e).split("\n")[0]
    return float(x.mean()), per_rank, synced, torch_says


def batchnorm_statistics(lab):
    import torch
    _warm()
    whole = np.concatenate(HALVES)
    bn = torch.nn.BatchNorm1d(1, affine=False).double()
    one = bn(torch.as_tensor(whole)[:, None]).detach().numpy()[:, 0]
    ranks = lab.world(2, "torch").run(batchnorm_on_ranks)
    per_rank = np.concatenate([r[1] for r in ranks])
    synced = np.concatenate([r[2] for r in ranks])
    k = int(np.abs(per_rank - one).argmax())
    return {"k": k, "x_k": float(whole[k]), "m0": ranks[0][0], "m1": ranks[1][0],
            "global_mean": float(whole.mean()),
            "per_rank_diff": float(np.abs(per_rank - one).max()),
            "synced_diff": float(np.abs(synced - one).max()),
            "one_k": float(one[k]), "rank_k": float(per_rank[k]),
            "torch_says": ranks[0][3]}


# --- 4. Compression hooks on torch's own DDP -----------------------------------------------------

COMPRESSION_STEPS = 20


def compressed_training(comm, hook_name, steps):
    """torch's own DDP over gloo with one of its communication hooks;
    counts the bytes the hook hands to all_reduce, step by step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(),
                        nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
    model = TorchDDP(net)
    rank1 = ps.PowerSGDState(None, matrix_approximation_rank=1,
                             start_powerSGD_iter=2)
    hooks = {"float32": (None, dh.allreduce_hook),
             "fp16": (None, dh.fp16_compress_hook),
             "bf16": (None, dh.bf16_compress_hook),
             "powersgd": (rank1, ps.powerSGD_hook)}
    state, hook = hooks[hook_name]
    try:
        model.register_comm_hook(state, hook)
    except TypeError as e:                  # bf16: NCCL only
        return str(e).split("\n")[0]
    sent = [0]
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):  # every hook calls this
        sent[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce, per_step, losses = counted, [], []
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    y = torch.sin(x[:, :4] * 2) + x[:, 4:8] * x[:, 8:12]
    half = slice(comm.rank * 32, (comm.rank + 1) * 32)
    try:
        for _ in range(steps):
            sent[0] = 0
            loss = torch.nn.functional.mse_loss(model(x[half]), y[half])
            loss.backward()
            with torch.no_grad():
                for w in model.parameters():
                    w -= 0.2 * w.grad
                    w.grad = None
            per_step.append(sent[0])
            losses.append(loss.item())
    finally:
        dist.all_reduce = real
    with torch.no_grad():
        whole = torch.nn.functional.mse_loss(net(x), y).item()
    return per_step, whole, sum(w.numel() for w in net.parameters())


def compression(lab):
    _warm()
    world, out = lab.world(2, "torch"), {"steps": COMPRESSION_STEPS}
    for name in ("float32", "fp16", "bf16", "powersgd"):
        ran = world.run(compressed_training, name, COMPRESSION_STEPS)[0]
        if isinstance(ran, str):            # refused on this backend: said, not measured
            out[f"{name}_refused"] = ran
            continue
        per_step, loss, n = ran
        out[name] = {"bytes": per_step[-1], "first": per_step[0], "loss": loss}
        out["params"] = n
    out.setdefault("bf16_refused", "")
    out["bf16_said"] = (f"on gloo it refuses: \"{out['bf16_refused']}\"" if out["bf16_refused"] else
                        f"{out['bf16']['bytes'] / out['float32']['bytes']:.2f}x")
    base = out["float32"]
    for name in ("fp16", "powersgd"):
        out[f"{name}_ratio"] = out[name]["bytes"] / base["bytes"]
        out[f"{name}_loss"] = out[name]["loss"] / base["loss"]
    out["f32_bytes"], out["ps_bytes"] = base["bytes"], out["powersgd"]["bytes"]
    out["ps_first"] = out["powersgd"]["first"]
    out["loss32"] = base["loss"]
    return out


# --- 5. Local SGD ---------------------------------------------------------------------------------

LOCAL_STEPS, H = 16, 4


def local_sgd(comm, every, steps):
    """Each rank steps on its own half; every ``every`` steps the ranks
    average their weights (every=0: all-reduce the gradient each step)."""
    import torch

    from dplab.backends import allreduce
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    net = net.double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    p, r = comm.world_size, comm.rank
    mine = slice(r * 64 // p, (r + 1) * 64 // p)
    params = list(net.parameters())
    sizes = [w.numel() for w in params]
    comm.tracer.enabled = True
    for step in range(steps):
        torch.nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
        with torch.no_grad():
            if every == 0:  # synchronous: average the gradient now
                flat = torch.cat([w.grad.reshape(-1) for w in params])
                allreduce(comm, flat.numpy(), op="mean")
                grads = flat.split(sizes)
            else:
                grads = [w.grad.reshape(-1) for w in params]
            for w, gr in zip(params, grads):
                w -= 0.1 * gr.view_as(w)
                w.grad = None
            if every and (step + 1) % every == 0:  # local SGD: average
                flat = torch.cat([w.reshape(-1) for w in params])
                allreduce(comm, flat.numpy(), op="mean")  # the weights
                for w, v in zip(params, flat.split(sizes)):
                    w.copy_(v.view_as(w))
    comm.tracer.enabled = False
    sent = sum(e.bytes for e in comm.tracer.take() if e.kind == "send")
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(net(x), y).item()
    return sent, loss, sum(w.numel() for w in params)


def local_sgd_bytes_and_loss(lab):
    _warm()
    world = lab.world(2, "torch")
    sync_sent, sync_loss, n = world.run(local_sgd, 0, LOCAL_STEPS)[0]
    local_sent, local_loss, _ = world.run(local_sgd, H, LOCAL_STEPS)[0]
    return {"steps": LOCAL_STEPS, "h": H, "params": n, "sync_sent": sync_sent, "local_sent": local_sent,
            "ratio": local_sent / sync_sent, "sync_loss": sync_loss, "local_loss": local_loss,
            "loss_ratio": local_loss / sync_loss}


# --- 6-9. FSDP's overlap, on a simulated DGX H100 -------------------------------------------------

FSDP_MODEL = MLPConfig(in_dim=256, hidden=(256,) * 6, out_dim=256)  # 7 layers of 65,792 weights


def fsdp_step(comm, zero):
    """One ZeRO-3 (FSDP) step of the engine on this rank: the step's
    virtual time, the bytes it sent, the most weights it held."""
    cfg = TrainConfig(model=FSDP_MODEL, global_batch=32, steps=1,
                      dtype="float32")
    comm.tracer.enabled = True
    result = train_zero(comm, cfg, zero)
    events = comm.tracer.take()
    step = next(e for e in events if e.kind == "zero_step")
    sent = sum(e.bytes for e in events if e.kind == "send"
               and step.t_start_ns <= e.t_start_ns < step.t_end_ns)
    return {"ms": (step.t_end_ns - step.t_start_ns) / 1e6, "sent": sent,
            "held": result.memory.params, "shard": result.shard_elems}


def _layers_held(run, p):
    """Whole layers a rank held at its peak: (peak - its shards) / a layer."""
    layer = 4 * (FSDP_MODEL.in_dim + 1) * FSDP_MODEL.hidden[0]
    return (run["held"] - 4 * run["shard"]) / layer


@cache
def _fsdp_run(p, prefetch, reshard):
    """Rank 0's fsdp_step (kept: steps 6 and 7 share the default run)."""
    zero = ZeroConfig(stage=3, prefetch=prefetch, reshard_after_forward=reshard)
    return launch(fsdp_step, p, backend="sim", cluster="dgx-h100", args=(zero,))[0]


def prefetch_on_and_off(lab):
    p = 4
    runs = {on: _fsdp_run(p, on, True) for on in (False, True)}
    off, on = runs[False], runs[True]
    return {"p": p, "layers": MLP(FSDP_MODEL).num_layers, "off_ms": off["ms"], "on_ms": on["ms"],
            "saved": 1 - on["ms"] / off["ms"], "held_off": _layers_held(off, p),
            "held_on": _layers_held(on, p), "same_bytes": off["sent"] == on["sent"]}


def reshard_or_keep(lab):
    p = 4
    runs = {rs: _fsdp_run(p, True, rs) for rs in (True, False)}
    yes, no = runs[True], runs[False]
    weights = MLP(FSDP_MODEL).num_params
    return {"p": p, "layers": MLP(FSDP_MODEL).num_layers, "weights": weights,
            "sent_reshard": yes["sent"], "sent_keep": no["sent"],
            "saved_bytes": yes["sent"] - no["sent"],
            "one_gather": (p - 1) * weights * 4 // p,
            "held_reshard": _layers_held(yes, p), "held_keep": _layers_held(no, p),
            "peak_ratio": no["held"] / yes["held"]}


def _part(schedule, name, rounds):
    return Schedule(name, schedule.world_size, schedule.num_chunks, rounds)


def _between_nodes(schedule, g):
    """The most of the buffer (a fraction) one GPU sends to the other node."""
    t = columns(schedule)
    out = (t.src // g) != (t.dst // g)
    return np.bincount(t.src[out], minlength=schedule.world_size).max() / schedule.num_chunks


def hsdp_against_fsdp(lab):
    c, p, g, n = "dgx-h100x2", 16, 8, 256 << 20
    rings = rings_per_nic(p, g)  # FSDP over 16: a ring per NIC
    two = allreduce_schedule(f"hierarchical:{g}", p)  # HSDP's phases
    k = (g - 1) + 2 * (p // g - 1)  # reduce-scatter in, all-reduce across
    parts = {"fsdp_grads": _part(rings, "rs 16", rings.rounds[:p - 1]),
             "fsdp_gather": _part(rings, "ag 16", rings.rounds[p - 1:]),
             "hsdp_grads": _part(two, "rs 8, ar 2", two.rounds[:k]),
             "hsdp_gather": _part(two, "ag 8", two.rounds[k:])}
    out = {"cluster": c, "p": p, "g": g, "n": n}
    for key, s in parts.items():
        out[f"{key}_ms"] = schedule_time(c, s, n).seconds * 1e3
        out[f"{key}_out"] = _between_nodes(s, g)
    # a step, resharded: two all-gathers and the gradients
    for who in ("fsdp", "hsdp"):
        out[f"{who}_out"] = (2 * out[f"{who}_gather_out"]
                             + out[f"{who}_grads_out"])
    out["out_ratio"] = out["fsdp_out"] / out["hsdp_out"]
    less = out["hsdp_out"] < out["fsdp_out"]
    out["fewer_between"] = "hsdp" if less else "fsdp"
    return out

def prefetch_exercise(lab):
    from dplab.lessons.exercises import EXERCISES
    from dplab.lessons.exercises import fsdp_prefetch as ex
    right = launch(ex._rank, ex.WORLD, backend="sim", cluster=ex.CLUSTER,
                   args=(str(EXERCISES["fsdp_prefetch"].solution),))[0]
    gathers = [right["gathers"][str(u)] for u in range(ex.UNITS)]
    computes = right["computes"]
    hidden = sum(ex.overlap((g["start"], g["end"]), (c["start"], c["end"]))
                 for g, c in zip(gathers[1:], computes))
    spent = sum(g["end"] - g["start"] for g in gathers[1:])
    serial = sum(g["end"] - g["start"] for g in gathers) + sum(c["end"] - c["start"]
                                                               for c in computes)
    return {"units": ex.UNITS, "world": ex.WORLD, "cluster": ex.CLUSTER,
            "compute_us": ex.COMPUTE_S * 1e6, "gather_us": spent / (ex.UNITS - 1) * 1e6,
            "first_us": (gathers[0]["end"] - gathers[0]["start"]) * 1e6,
            "right_us": right["total"] * 1e6, "serial_us": serial * 1e6,
            "hidden": hidden / spent, "held": max(len(c["held"]) for c in computes),
            "ok": not right["problem"]}

STEPS = (
    Step(
        title="Exercise: DDP from hooks on torch tensors",
        text=("torch lets you attach a hook to a tensor that fires when backward has finished that "
              "parameter's gradient: `param.register_post_accumulate_grad_hook(hook)`. That is all DDP "
              "needs. In the hook, launch an asynchronous all-reduce of `param.grad` "
              "(`dist.all_reduce(..., async_op=True)` returns at once with a handle) and keep the handle; "
              "backward goes on with the earlier layers while the gradient travels. Before the optimizer "
              "steps, wait on every handle.\n\n"
              "The shipped answer, on two gloo ranks: each backward launched {per_backward} all-reduces, "
              "one per parameter tensor, all waited for in `finish()`, and after {steps} steps the ranks "
              "hold one process's parameters (within {diff:diff}). One all-reduce per tensor pays one "
              "latency each: that is why DDP gathers them into buckets (lesson 4). Your turn: "
              "`dplab lesson init DIR`, write `attach_ddp_hooks` in `ddp_hooks.py`, then "
              "`dplab lesson check 15 DIR`: it trains with your hooks and names what went wrong."),
        run=ddp_from_hooks,
        inputs={"tensors": HOOK_TENSORS},
        checks=(Check("one all-reduce per parameter tensor per backward ({per_backward})",
                      lambda f: f["per_backward"] == f["tensors"]),
                Check("every handle was waited for in finish(), none inside a hook",
                      lambda f: f["waited_in_finish"]),
                Check("both ranks equal one process (relative 1e-10, float64)", lambda f: f["diff"] < 1e-10)),
        predict=Predict("The MLP has {tensors} parameter tensors (3 layers: a weight and a bias each). "
                        "With a hook on each, how many all-reduces does one backward launch?",
                        "per_backward",
                        misconceptions=((1, "one is DDP with a single bucket; these hooks fire once per "
                                            "tensor"),
                                        (3, "a hook belongs to a tensor, not a layer: weights and biases "
                                            "each get one"))),
        hint=HOOK_HINTS[0],
        hints=HOOK_HINTS[1:],
        try_this="dplab lesson init ex && dplab lesson check 15 ex   # then fill in ex/ddp_hooks.py",
        exercise="ddp_hooks",
        show=("dplab.lessons.exercises.stubs.ddp_hooks.attach_ddp_hooks",),
        teaches=("torch-stack",),
    ),
    Step(
        title="DistributedSampler: set_epoch, and the samples padding repeats",
        text=("torch's `DistributedSampler` gives each rank the same number of samples: with {n} samples "
              "on {p} ranks it hands out {handed} ({per_rank} a rank), repeating samples {repeated} to "
              "fill the last places (`drop_last=True` instead drops {dropped}). Its shuffle is seeded by "
              "the epoch, which you must tell it: without `set_epoch`, epoch 1 shuffles as epoch 0 did "
              "(rank 0 gets {e0} both times); with `set_epoch(1)` it gets {e1}.\n\n"
              "The repeats bias the gradient: DDP averages the ranks' means, so the repeated samples "
              "count twice. On a linear model the gradient is {padded_err:.1%} off the full data set's. "
              "dplab shards the same {n} samples unevenly ({shard_sizes}) and weighs each rank's mean by "
              "its share n_r / N (reference/data.py, `DDP(local_batch_size=...)`): off by "
              "{weighted_err:.1e}, rounding."),
        run=sampler_against_shards,
        inputs={"n": 10, "p": 4},
        checks=(Check("padding hands out {handed} samples for {n}, repeating {n_repeated}",
                      lambda f: f["handed"] == 12 and f["n_repeated"] == 2),
                Check("without set_epoch the next epoch repeats the same order; with it, another",
                      lambda f: f["same_without_set_epoch"] and f["differs_with_set_epoch"]),
                Check("the padded average is off the full gradient by more than 1%",
                      lambda f: f["padded_err"] > 0.01),
                Check("the weighted uneven shards give the full gradient (1e-12)",
                      lambda f: f["weighted_err"] < 1e-12)),
        predict=Predict("DistributedSampler, {n} samples, {p} ranks, shuffle on, drop_last off: how many "
                        "samples does one epoch hand out, all ranks together?", "handed",
                        misconceptions=((10, "every rank must get the same count, so it pads to a multiple "
                                             "of the ranks"),
                                        (8, "that is drop_last=True, which drops the remainder"))),
        hint="ceil(n / p) samples a rank, on every rank.",
        try_this="python -c 'from torch.utils.data.distributed import DistributedSampler as S; "
                 "print(list(S(range(10), 4, 0)))'",
        show=("torch.utils.data.distributed.DistributedSampler.__iter__",),
        teaches=("torch-stack",),
    ),
    Step(
        title="SyncBatchNorm: per-rank statistics are not one device's",
        text=("BatchNorm normalises with the batch's own mean and variance, and under data parallelism "
              "each rank sees only its shard. Here rank 0's samples have mean {m0} and rank 1's {m1} "
              "(an unshuffled loader, sorted by class, does this); the whole batch's mean is "
              "{global_mean}. Each rank's BatchNorm subtracts its own: the outputs are up to "
              "{per_rank_diff:.3g} away from one device's (the sample {x_k:g} becomes {rank_k:.3f} "
              "on its rank, {one_k:.3f} on one device). SyncBatchNorm all-reduces each rank's sum, "
              "sum of squares and count, and every rank normalises with the whole batch's statistics: "
              "within {synced_diff:diff} of one device. torch's own `nn.SyncBatchNorm` computes the "
              "same statistics on GPUs, by another collective: it all-gathers each rank's mean, inverse "
              "standard deviation and count, and combines them; on this CPU it says: \"{torch_says}\"."),
        run=batchnorm_statistics,
        inputs={"m0": -2.0, "m1": 2.0},
        checks=(Check("per-rank BatchNorm differs from one device's (by more than 0.5)",
                      lambda f: f["per_rank_diff"] > 0.5),
                Check("the synced statistics give one device's output (1e-12)",
                      lambda f: f["synced_diff"] < 1e-12)),
        predict=Predict("Rank 0's four samples have mean {m0}, rank 1's four have mean {m1}. What mean does "
                        "one device's BatchNorm subtract from the whole batch of eight?", "global_mean",
                        misconceptions=((-2, "that is rank 0's own mean: what per-rank BatchNorm uses"),
                                        (2, "that is rank 1's own mean: what per-rank BatchNorm uses"))),
        hint="The mean of two equal halves is the mean of their means.",
        show=(sync_batch_stats,),
        teaches=("torch-stack",),
    ),
    Step(
        title="Compressing gradients: fp16, bf16 and PowerSGD hooks",
        text=("torch's DDP hands each bucket to a *communication hook* if you register one "
              "(`torch.distributed.algorithms.ddp_comm_hooks`). Counting the bytes each hook gives to "
              "all_reduce, per step, on two gloo ranks ({params:,} float32 parameters): plain "
              "{f32_bytes:size}; `fp16_compress_hook` {fp16_ratio:.2f}x that (each gradient cast to "
              "float16, summed, cast back); `bf16_compress_hook` {bf16_said}; `powerSGD_hook` at "
              "matrix rank 1 (`matrix_approximation_rank=1`; not a process rank) "
              "{powersgd_ratio:.3f}x ({ps_bytes:size}): each weight matrix M is sent as two thin "
              "factors P and Q with M ≈ P Qᵀ, and what the approximation missed is kept and added to the "
              "next step's gradient (error feedback). Its first step sends all {ps_first:size}: "
              "PowerSGD starts after a plain warm-up.\n\n"
              "After {steps} SGD steps the loss on the whole data set, relative to uncompressed "
              "({loss32:.4f}): fp16 {fp16_loss:.4f}x, PowerSGD "
              "{powersgd_loss:.3f}x. Fewer bytes are not free: a gradient cut to matrix rank 1 changes "
              "the path."),
        run=compression,
        checks=(Check("fp16 hands all_reduce exactly half the bytes (bf16 too, where NCCL runs it)",
                      lambda f: f["fp16_ratio"] == 0.5 and (f["bf16_refused"] or "0.50x" in f["bf16_said"])),
                Check("PowerSGD sends under a tenth once it starts, all of it before",
                      lambda f: f["powersgd_ratio"] < 0.1 and f["ps_first"] == f["f32_bytes"]),
                Check("fp16 ends within 1% of the uncompressed loss",
                      lambda f: abs(f["fp16_loss"] - 1) < 0.01),
                Check("PowerSGD still trains: its loss within 2x of uncompressed",
                      lambda f: f["powersgd"]["loss"] < 2 * f["loss32"])),
        hint="A 128 × 128 weight at matrix rank 1 becomes 128 + 128 numbers.",
        try_this=("python -c 'import torch.distributed.algorithms.ddp_comm_hooks as h; "
                  "print(list(h.DDPCommHookType))'"),
        show=(compressed_training,),
        teaches=("compression",),
    ),
    Step(
        title="Local SGD: average the weights every H steps",
        text=("Another way to cut communication is to talk less often. In local SGD each rank steps on "
              "its own shard alone and, every H = {h} steps, the ranks average their weights with one "
              "all-reduce. Over {steps} steps, rank 0 sends {sync_sent:size} when it all-reduces the "
              "gradient every step and {local_sent:size} with local SGD: {ratio:.2f}x, the 1/H the "
              "schedule says (dplab's tracer counts the bytes). The price is drift: between averages the "
              "replicas differ. Here it is small, the loss on the whole data set {local_loss:.4f} against "
              "{sync_loss:.4f} ({loss_ratio:.3f}x); a larger H, or shards less alike, costs more. torch "
              "has it too: `post_localSGD_hook` and `PeriodicModelAverager`."),
        run=local_sgd_bytes_and_loss,
        inputs={"h": H},
        checks=(Check("local SGD sends 1/H of the bytes (the same buffer size, H times less often)",
                      lambda f: abs(f["ratio"] - 1 / f["h"]) < 1e-12),
                Check("and still trains: its loss within 2x of synchronous SGD's",
                      lambda f: f["local_loss"] < 2 * f["sync_loss"])),
        predict=Predict("Synchronous SGD all-reduces the gradient every step; local SGD all-reduces the "
                        "weights (the same size) every H = {h} steps. What fraction of the bytes does it "
                        "send?", "ratio", rel_tol=0.01,
                        misconceptions=((0.5, "an all-reduce of the weights costs what one of the gradient "
                                              "does: only how often changes"),)),
        hint="The same buffer, 1 time in H.",
        show=(local_sgd,),
        teaches=("compression",),
    ),
    Step(
        title="FSDP prefetch: the next unit's gather under this unit's compute",
        text=("FSDP (ZeRO-3) all-gathers a unit's weights just before it runs. The engine's stage "
              "3 (`ShardedParams.acquire`, shown) can hand the NEXT use's gather to its comm "
              "thread before this one computes. One step of an MLP of {layers} equal layers on "
              "p={p} simulated H100s (dgx-h100, virtual time):\n\n- gathered when needed: "
              "{off_ms:.3f} ms, at most {held_off:.0f} layer whole at once;\n- prefetched: "
              "{on_ms:.3f} ms, {saved:.0%} less, with {held_on:.0f} layers whole at once: the one "
              "computing and the next.\n\nThe same bytes either way (checked): prefetch moves no "
              "byte less, it moves them while the device is busy. Only forward's first gather is "
              "waited for in full. torch's FSDP calls these `forward_prefetch` and "
              "`backward_prefetch=BACKWARD_PRE` (dplab's torch wrapper has both: "
              "`dplab.backends.nn.fsdp`)."),
        run=prefetch_on_and_off,
        checks=(Check("prefetch makes the step faster on the simulated node",
                      lambda f: f["on_ms"] < f["off_ms"]),
                Check("and sends the same bytes", lambda f: f["same_bytes"]),
                Check("it holds one layer more: 2 whole layers at most, against 1",
                      lambda f: f["held_on"] == 2 and f["held_off"] == 1)),
        predict=Predict("With prefetch, at most how many of the {layers} layers does a rank hold "
                        "whole at once?", "held_on", misconceptions=(
                            (1, "one is FSDP without prefetch; with it, the next layer's gather "
                                "runs while this one computes, so both are whole"),
                            (7, "all of them is plain data parallelism (or "
                                "reshard_after_forward=False, next step); FSDP frees each layer "
                                "after it has run"))),
        hint="The layer computing, and the one whose gather runs meanwhile.",
        try_this="dplab train --backend sim --cluster dgx-h100 --world-size 8 --zero-stage 3 "
                 "--trace run.json",
        teaches=("fsdp-overlap",),
        show=("dplab.reference.zero.params.ShardedParams.acquire",),
        inputs={"layers": 7, "p": 4},
    ),
    Step(
        title="reshard_after_forward: a second gather, or every layer held",
        text=("After a unit's forward, FSDP frees its gathered weights (resharding) and gathers "
              "them again for its backward. `reshard_after_forward=False` (torch's SHARD_GRAD_OP, "
              "ZeRO-2's weights) keeps them instead. The same step on p={p} simulated H100s:\n\n- "
              "resharded: rank 0 sends {sent_reshard:size} a step and holds at most "
              "{held_reshard:.0f} layers whole;\n- kept: {sent_keep:size}, {saved_bytes:,} bytes "
              "less, exactly one all-gather of the {weights:,} weights ((p-1)/p of them, 4 bytes "
              "each: {one_gather:,}); but at the turn from forward to backward all {held_keep:.0f} "
              "layers are whole at once: a peak {peak_ratio:.1f}x the resharded one.\n\nSo the "
              "trade is one gather of the model a step (the backward's) against holding the model "
              "whole at its peak. A model that fits whole only for a moment is the case for "
              "keeping; one that does not fit is the case for FSDP."),
        run=reshard_or_keep,
        checks=(Check("keeping saves exactly one all-gather of the model a step",
                      lambda f: f["saved_bytes"] == f["one_gather"]),
                Check("and holds every layer whole at its peak, against 2 resharded",
                      lambda f: f["held_keep"] == f["layers"] and f["held_reshard"] == 2)),
        predict=Predict("With reshard_after_forward=False, how many of the {layers} layers does a "
                        "rank hold whole at its peak?", "held_keep", misconceptions=(
                            (2, "two is the resharded step with prefetch; kept layers wait for "
                                "their backward, so at the turn all of them are whole"),)),
        hint="A kept layer stays until its backward, and backward starts with the last layer.",
        teaches=("fsdp-overlap",),
        show=("dplab.reference.zero.params.ShardedParams.release",),
        inputs={"layers": 7},
    ),
    Step(
        title="HSDP: shard inside a node, replicate across nodes",
        text=("On two DGX H100 nodes ({cluster}, p={p}), FSDP can shard a unit over all {p} GPUs, "
              "or HSDP (torch's HYBRID_SHARD) over the {g} GPUs of each node, with each node a "
              "replica. For a unit of {n:size}, on the simulator (FSDP's collectives on {g} rings, "
              "one per NIC as NCCL runs them; HSDP's are the hierarchical all-reduce's "
              "phases):\n\n| | all-gather (twice a step) | gradients |\n|---|---|---|\n| FSDP over "
              "{p} | {fsdp_gather_ms:.3f} ms | reduce-scatter {fsdp_grads_ms:.3f} ms |\n| HSDP | "
              "{hsdp_gather_ms:.3f} ms, NVLink only | reduce-scatter in, all-reduce across: "
              "{hsdp_grads_ms:.3f} ms |\n\nA GPU sends {fsdp_out:.3f} n to the other node a step "
              "under FSDP and {hsdp_out:.3f} n under HSDP: {out_ratio:.1f}x less, because HSDP's "
              "gathers never leave the node. The gathers stand in front of each unit's compute "
              "(prefetch hides what it can), while the gradients' all-reduce runs under backward "
              "(lesson 4), so HSDP puts its one slow collective where it hides; here it is the "
              "slower one. The price is memory: each GPU holds 1/{g} of the unit, twice FSDP's "
              "1/{p}."),
        run=hsdp_against_fsdp,
        checks=(Check("HSDP's all-gather is faster, and never crosses between the nodes",
                      lambda f: f["hsdp_gather_ms"] < f["fsdp_gather_ms"]
                      and f["hsdp_gather_out"] == 0),
                Check("HSDP sends over 2x fewer bytes between the nodes a step",
                      lambda f: f["out_ratio"] > 2),
                Check("its gradient sync, all of it between the nodes, is the slower one",
                      lambda f: f["hsdp_grads_ms"] > f["fsdp_grads_ms"])),
        predict=Predict("FSDP over all {p} GPUs or HSDP (shard in a node, replicate across): which "
                        "sends fewer bytes between the nodes a step?", "fewer_between",
                        choices=("fsdp", "hsdp"), misconceptions=(
                            ("fsdp", "FSDP's shards are smaller, but all three of its "
                                     "collectives cross the nodes; HSDP's two gathers stay "
                                     "inside"),)),
        hint="Which of HSDP's collectives has to leave the node at all?",
        teaches=("fsdp-overlap",),
        show=(hsdp_against_fsdp,),
        inputs={"p": 16},
    ),
    Step(
        title="Exercise: an FSDP forward that prefetches",
        text=("Write the prefetch yourself: `forward_units(n_units, gather, compute)` in "
              "`fsdp_prefetch.py` (`dplab lesson init DIR`), checked with `dplab lesson check 15 "
              "DIR` on {world} simulated H100s ({cluster}). The check measures what your code "
              "does: which units' weights are still alive when each unit runs, whether each unit "
              "waited on its own handle, and how much of each gather ran under the previous "
              "compute.\n\nThe shipped answer runs {units} units of {compute_us:.0f} µs each in "
              "{right_us:.0f} µs (the first gather, then the {units} computes back to back), with "
              "{hidden:.0%} of the gathers after the first ({gather_us:.1f} µs each) hidden and at "
              "most {held} units held. One after another, as the stub does them, they take "
              "{serial_us:.0f} µs. Issue the prefetch after the compute, wait on the wrong handle, "
              "keep every unit, or gather them all up front, and the check names it."),
        run=prefetch_exercise,
        checks=(Check("the shipped answer hides every gather after the first",
                      lambda f: f["hidden"] == 1.0 and f["held"] == 2),
                Check("its forward is the first gather and the computes: one after another adds "
                      "the other gathers",
                      lambda f: abs(f["right_us"] - f["first_us"]
                                    - f["units"] * f["compute_us"]) < 0.5
                      and abs(f["serial_us"] - f["right_us"] - 7 * f["gather_us"]) < 0.5),
                Check("it ran without a problem", lambda f: f["ok"])),
        predict=Predict("{units} units, each gather about 6 µs and each compute {compute_us:.0f} "
                        "µs: how "
                        "long, in µs, does a perfectly prefetched forward take?", "right_us",
                        rel_tol=0.05,
                        unit="µs", misconceptions=(
                            (128, "that is gather and compute one after the other: only the first "
                                  "gather is waited for"),
                            (80, "the first gather has nothing to hide behind"))),
        hint=PREFETCH_HINTS[0],
        hints=PREFETCH_HINTS[1:],
        try_this="dplab lesson check 15 ex   # fsdp_prefetch.py, on the simulated dgx-h100",
        exercise="fsdp_prefetch",
        teaches=("fsdp-overlap",),
        show=("dplab.lessons.exercises.stubs.fsdp_prefetch.forward_units",),
        inputs={"units": 8, "compute_us": 10.0},
    ),
)


LESSON = Lesson(15, "torch_stack", "The real PyTorch stack, and cutting communication",
                "DDP from tensor hooks, torch's sampler and SyncBatchNorm, what gradient "
                "compression and local SGD save in bytes and cost in loss, and how FSDP hides its "
                "gathers.",
                STEPS, needs=("torch",))
