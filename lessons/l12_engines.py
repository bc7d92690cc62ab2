"""Lesson 12: DataParallel against DistributedDataParallel, and the engines under them.

    dplab lesson 12              # needs the torch and mpi extras: pip install -e ".[all]"

Five steps: torch's single-process DataParallel (against DDP on a simulated 8-GPU node, and
what runs of it here without GPUs); torch's own DDP over gloo and dplab's, each equal to one
process on the whole batch; inside
torch's DDP (buckets rebuilt from the first backward, unused parameters, buffers); one
training run on MPI, gloo and shared memory ending in the same bits; and the launchers that take
the same code past one machine (the lines the multi-host test runs).
"""

from __future__ import annotations

import numpy as np

from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]


def data_parallel_here(lab):
    import torch
    gpus = torch.cuda.device_count()
    # DataParallel wants the module and batch on its first device
    dev = "cuda:0" if gpus else "cpu"
    model = torch_model().to(dev)
    dp = torch.nn.DataParallel(model)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        spread, alone = dp(x.to(dev)), model(x.to(dev))
    # one device: the same call; several: slices of the batch, so
    # another matrix shape, and rounding may differ
    same = (torch.equal(spread, alone) if gpus <= 1
            else torch.allclose(spread, alone, rtol=1e-5, atol=1e-6))
    weights = sum(p.numel() * p.element_size()
                  for p in model.parameters())
    here = ("DataParallel has nothing to spread over: `device_ids` is "
            f"{dp.device_ids}, and its forward is a plain call of the "
            "module, the same outputs to the bit" if not gpus else
            f"`device_ids` is {dp.device_ids}, and its outputs match "
            "the module's")
    return _simulated_node() | {"gpus": gpus, "device_ids": dp.device_ids,
            "plain_call": not dp.device_ids, "here": here,
            "same": bool(same), "weights": weights,
            "copied_8": 7 * weights, "processes": 1}


NODE = "dgx-h100"         # one simulated node of 8 H100s on NVLink
NODE_ROWS = (16, 2)       # windows of 1,024 tokens per GPU: GPU-bound, then launch-bound


def dp_against_ddp(rows, cluster=NODE):
    """Lesson 14's GPT at GPT-2 small's size, one step on 8 simulated
    GPUs: (DataParallel s, DDP s, operations a replica, one GPU's s)."""
    from dplab.backends.sim.timing import data_parallel_step_time, ddp_step_time
    from dplab.lessons.priced import GPT2_SMALL, ddp_layers, price_units
    u = price_units(GPT2_SMALL, rows)
    units = [(n, [(o.flops, o.nbytes) for o in f],
              [(o.flops, o.nbytes) for o in b])
             for _, n, f, b in u.in_order()]
    opt, layers = u.optimizer_s(cluster), ddp_layers(u, cluster)
    dp = data_parallel_step_time(cluster, 8, units, u.dtype, opt)
    ddp = ddp_step_time(cluster, 8, layers, 25.0, "ring", 2, opt)
    one = ddp_step_time(cluster, 1, layers, 25.0, "ring", 2, opt)
    ops = sum(len(f) + len(b) for _, _, f, b in u.in_order())
    return dp.seconds, ddp.seconds, ops, one.seconds


def _simulated_node():
    from dplab.reference.cluster import cluster
    c = cluster(NODE)
    from dplab.lessons.priced import GPT2_SMALL
    out = {"node": NODE, "node_gpus": c.size, "launch_us": c.device.op_overhead_s * 1e6,
           "block": GPT2_SMALL.block, "h200_thread_us": cluster("h200").per_thread * 1e6}
    for k, rows in zip(("big", "small"), NODE_ROWS):
        dp, ddp, ops, one = dp_against_ddp(rows)
        out |= {f"{k}_rows": rows, f"{k}_dp_ms": dp * 1e3, f"{k}_ddp_ms": ddp * 1e3,
                f"{k}_x": dp / ddp, f"{k}_gpu_ms": one * 1e3, "ops": ops,
                f"{k}_host_ms": c.size * ops * c.device.op_overhead_s * 1e3}
    return out


def torch_model():
    import torch
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def train_torch(comm, steps, batch):
    """One process on the whole batch when ``comm`` is None, else DDP
    on this rank's half."""
    import torch

    from dplab.backends.nn.ddp import DistributedDataParallel
    seeded = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 8, generator=seeded)
    y = torch.ones(batch, 1)
    model = torch_model()
    if comm is not None:
        r = comm.rank
        half = slice(r * batch // 2, (r + 1) * batch // 2)
        x, y = x[half], y[half]
        model = DistributedDataParallel(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        # DDP averages the two halves' gradients
        loss.backward()
        opt.step()
    flat = [p.detach().flatten() for p in model.parameters()]
    return torch.cat(flat).numpy()


def train_torch_ddp(comm, steps, batch):
    """torch's own DistributedDataParallel, on the gloo process
    group the torch backend's ranks joined."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    seeded = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 8, generator=seeded)
    y = torch.ones(batch, 1)
    r = comm.rank
    half = slice(r * batch // 2, (r + 1) * batch // 2)
    model = DistributedDataParallel(torch_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[half]), y[half])
        loss.backward()
        opt.step()
    flat = [p.detach().flatten() for p in model.parameters()]
    return torch.cat(flat).numpy()


def ddp_equals_one_process(lab):
    steps, batch = 10, 64
    # (imports torch before the ranks fork)
    alone = train_torch(None, steps, batch)
    replicas = lab.world(2).run(train_torch, steps, batch)
    theirs = lab.world(2, "torch").run(train_torch_ddp, steps, batch)
    first = replicas[0]
    return {"identical": all(np.array_equal(r, first) for r in replicas),
            "torch_identical": all(np.array_equal(r, theirs[0]) for r in theirs),
            "steps": steps, "batch": batch,
            "diff": float(np.abs(first - alone).max()),
            "torch_diff": float(np.abs(theirs[0] - alone).max()),
            "params": len(alone)}


def registered_net(unused=False):
    """A torch module whose layers are registered c, a, b but run
    a -> b -> c, with a buffer and, if asked, a layer it never uses."""
    import torch
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.c = nn.Linear(64, 1)
            self.a = nn.Linear(8, 64)
            self.b = nn.Linear(64, 64)
            self.spare = nn.Linear(8, 1) if unused else None
            self.register_buffer("stamp", torch.zeros(1))

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    return Net()


def buffer_option():
    """The name of torch DDP's per-forward buffer broadcast switch
    (broadcast_buffers, renamed forward_sync_buffers in a later torch)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP
    params = inspect.signature(DDP.__init__).parameters
    return ("forward_sync_buffers" if "forward_sync_buffers" in params
            else "broadcast_buffers")


def renamed_in():
    """The torch version whose DDP docstring deprecates ``broadcast_buffers`` (None: not said)."""
    import re

    from torch.nn.parallel import DistributedDataParallel as DDP
    found = re.search(r"broadcast_buffers \(.*?deprecated:: ([0-9.]+)", DDP.__doc__ or "", re.S)
    return found and found.group(1)


CAP = 16484     # bytes: one 64x64 float32 weight and a bias fit


def ddp_inside(comm):
    """torch's DDP on this rank, as Li et al. (VLDB 2020) describe it."""
    import warnings

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    x, out = torch.randn(4, 8), {}
    # 1. buckets, before and after the first backward
    net = registered_net()
    ddp = DDP(net, bucket_cap_mb=CAP / 2**20)
    names = [n for n, _ in net.named_parameters()]
    for _ in range(3):   # rebuilt in the second; logged by the third
        ddp(x).sum().backward()
    log = ddp._get_ddp_logging_data()
    out["names"] = names
    out["first"] = log["bucket_sizes"]
    rebuilt = log["rebuilt_per_bucket_param_indices"]   # "1 0 5 4, 3 2"
    out["rebuilt"] = [[names[int(i)] for i in b.split()]
                      for b in rebuilt.split(",")]
    # 2. an unused parameter: the default, then the two ways out
    for kind, kw in (("default", {}),
                     ("find", {"find_unused_parameters": True}),
                     ("static", {"static_graph": True})):
        ddp = DDP(registered_net(unused=True), **kw)
        try:
            for _ in range(2):
                ddp(x).sum().backward()
            out[kind] = "it ran"
        except RuntimeError as e:
            out[kind] = str(e).split(". ")[0]
    # 3. buffers: each rank stamps its own; does one forward overwrite it?
    for sync in (True, False):
        net = registered_net()
        net.stamp.fill_(comm.rank + 1)
        with warnings.catch_warnings():        # the old name is deprecated
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DDP(net, **{buffer_option(): sync})
        net.stamp.fill_(comm.rank + 1)         # after the start's broadcast
        ddp(x)
        out[f"stamp_{sync}"] = float(net.stamp)
    return out


def inside_ddp(lab):
    ranks = lab.world(2, "torch").run(ddp_inside)
    r0, r1 = ranks
    rebuilt = " | ".join(", ".join(b) for b in r0["rebuilt"])
    first = [int(b) for b in r0["first"].split(",")]
    return {"names": ", ".join(r0["names"]), "first_count": len(first),
            "first_bytes": sum(first),
            "rebuilt": rebuilt, "rebuilt_lists": r0["rebuilt"],
            "first_bucket": r0["rebuilt"][0][0].split(".")[0],
            "same_on_ranks": r0["rebuilt"] == r1["rebuilt"],
            "unused_error": r0["default"], "find": r0["find"],
            "static": r0["static"], "option": buffer_option(),
            "renamed": "" if buffer_option() == "broadcast_buffers"
            else f", called `broadcast_buffers` before torch {renamed_in()}"
            if renamed_in() else ", formerly `broadcast_buffers`",
            "stamp_on": r1["stamp_True"], "stamp_off": r1["stamp_False"],
            "stamp_0": r0["stamp_True"]}


def train_ring(comm, cfg):
    return train_sync(comm, cfg, SyncConfig("ring")).params


def engine_name(comm):
    if type(comm).__name__ == "MpiComm":
        from mpi4py import MPI
        library = MPI.Get_library_version().split("\n")[0].split()[0]
        return library + f" (size {MPI.COMM_WORLD.Get_size()})"
    if type(comm).__name__ == "TorchComm":
        import torch.distributed as dist
        size = dist.get_world_size()
        return f"torch.distributed {dist.get_backend()} (size {size})"
    return "shared memory"


def three_engines(lab):
    cfg, params, engines = TrainConfig(steps=20), {}, {}
    for backend in ("local", "mpi", "torch"):
        world = lab.world(2, backend)
        params[backend] = world.run(train_ring, cfg)[0]
        engines[backend] = world.run(engine_name)[0]
    same = all(np.array_equal(params["local"], params[b]) for b in params)
    return {"same_bits": same,
            "verdict": "identical" if same else "different",
            "steps": cfg.steps,
            "engines": "; ".join(f"{b}: {e}" for b, e in engines.items())}


def engine_rank(comm):
    """This rank's number as the engine itself counts it."""
    if type(comm).__name__ == "MpiComm":
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank()
    import torch.distributed as dist
    return dist.get_rank()


def launch_lines(nodes=2, gpus=8):
    """The lines tests/test_hosts_launchers.py runs across network
    namespaces, built by the same Cluster methods, for hosts named
    node0, node1, ... instead of the namespaces' addresses."""
    from dplab.backends.hosts.netns import Cluster
    cluster = Cluster(hosts=nodes, ranks_per_host=gpus)
    cluster.addrs = [f"node{i}" for i in range(nodes)]
    torch = [["DPLAB_DEVICE=cuda", "torchrun",
              *cluster.torchrun_args(i, "job1"),
              "-m", "dplab.backends.cli", "train", "--backend", "torch"]
             for i in range(nodes)]
    mpi = ["mpiexec", "-hosts", cluster.mpi_hosts(),
           "-n", str(nodes * gpus), "dplab", "train", "--backend", "mpi"]
    return torch, mpi


def who_numbered_the_ranks(lab):
    mpi, gloo = lab.world(2, "mpi"), lab.world(2, "torch")
    torch_lines, mpi_line = launch_lines()
    shown = ["    " + " ".join(argv) for argv in torch_lines]
    return {"torch_lines": "\n".join(shown),
            "mpi_line": "    " + " ".join(mpi_line),
            "torch_argv": torch_lines,
            "mpi_engine": mpi.run(engine_name)[0],
            "torch_engine": gloo.run(engine_name)[0],
            "mpi_ranks": mpi.run(engine_rank),
            "torch_ranks": gloo.run(engine_rank)}


STEPS = (
    Step(
        title="DataParallel: one process drives every device",
        text=("torch's `nn.DataParallel` runs in ONE Python process. Each forward it copies the module to "
              "every GPU (the weights broadcast from GPU 0: with 8 GPUs and this model's {weights:,} bytes "
              "of weights, {copied_8:,} bytes a step before any work), scatters the batch from GPU 0, runs "
              "the replicas in threads that share one interpreter and its lock (the GIL), and gathers the "
              "outputs back on GPU 0; backward sums every gradient onto GPU 0 (`reduce_add`, an NCCL "
              "reduce), where the one optimizer steps. All of it on one machine. The costs are the "
              "re-copy every step, the GIL, and GPU 0 as the hub of every scatter, gather and sum.\n\n"
              "**On a simulated node of {node_gpus} H100s** (`{node}`, simulated time), lesson 14's "
              "GPT at GPT-2 small's size, one step. DataParallel's process launches every replica's "
              "operations in turn ({ops} a replica, {launch_us:.0f} µs of host time each) while the "
              "GPUs run them behind; DDP's {node_gpus} processes launch their own at once. With "
              "{big_rows} windows of {block:,} tokens per GPU, each GPU computes {big_gpu_ms:.3g} ms and "
              "the launches, {big_host_ms:.3g} ms for all replicas, fit under it: DataParallel takes "
              "{big_dp_ms:.3g} ms against DDP's {big_ddp_ms:.3g} ({big_x:.2f}x), the rest being its "
              "weights broadcast and gradients reduced through GPU 0 after backward, with nothing "
              "overlapped. With {small_rows} windows the GPU's work shrinks to {small_gpu_ms:.3g} ms "
              "but the launches do not ({small_host_ms:.3g} ms): the one process is the bottleneck, "
              "{small_dp_ms:.3g} ms against DDP's {small_ddp_ms:.3g}, **{small_x:.1f}x**. The model "
              "leaves out the threads' contention for the interpreter's lock ({h200_thread_us:.1f} µs "
              "per thread an "
              "operation, measured on an H200 for the cuda backend), which would only add to "
              "DataParallel's side.\n\n"
              "**On this machine**, with {gpus} GPUs, {here} ({same}): what the copies and the GIL cost "
              "needs several GPUs to measure; `torch.nn.DataParallel(model)` takes every visible one."),
        run=data_parallel_here,
        checks=(Check("simulated: DataParallel is slower than DDP at both batches, and far slower "
                      "(over 2x) when the launches outlast the GPU's work",
                      lambda f: 1 < f["big_x"] < f["small_x"] and f["small_x"] > 2),
                Check("simulated: the launches fit under the GPU's work at {big_rows} windows and "
                      "outlast it at {small_rows}",
                      lambda f: f["big_host_ms"] < f["big_gpu_ms"]
                      and f["small_host_ms"] > f["small_gpu_ms"]),
                Check("simulated: DataParallel's step is at least all its launches",
                      lambda f: f["small_dp_ms"] >= f["small_host_ms"]),
                Check("without GPUs, DataParallel is a plain call of the module",
                      lambda f: f["gpus"] > 0 or (f["plain_call"] and f["same"])),
                Check("with GPUs, it spreads over every one of them, with the module's outputs",
                      lambda f: f["gpus"] == 0 or (len(f["device_ids"]) == f["gpus"] and f["same"]))),
        predict=Predict("DataParallel on a machine with 8 GPUs: how many Python processes drive them?",
                        "processes", misconceptions=((8, "that is DistributedDataParallel: one process "
                                                      "per GPU; DataParallel drives all of them from one, "
                                                      "with a thread each"),)),
        hint="Its name says parallel, its design says one process: threads, one per GPU.",
        show=("torch.nn.DataParallel.forward",),
        try_this="python -c \"import torch; print(torch.nn.DataParallel(torch.nn.Linear(2, 1)).device_ids)\"",
        teaches=("dp-vs-ddp",),
    ),
    Step(
        title="DistributedDataParallel: a process per rank, nobody in the middle",
        text=("`DistributedDataParallel` wraps a torch module in each of several processes, one per "
              "device. The parameters are broadcast once, at the start; after that the replicas stay equal "
              "because backward hooks all-reduce the gradients in buckets and average them, so every "
              "rank takes the same step, and no rank is a hub for the gradients. (What does travel every "
              "step, by default, is the module's buffers, broadcast from rank 0 at each forward: the next "
              "step.) torch's own DDP, two processes over "
              "gloo: {steps} SGD steps on each rank's half of a {batch}-sample batch end where one process "
              "on all {batch} ends, {torch_diff:.1e} apart ({params} parameters, float32); its replicas "
              "are identical ({torch_identical}). dplab's DDP (`backends/nn/ddp.py`, the same API over "
              "dplab's own all-reduce, on shared memory): {diff:.1e} apart, replicas identical "
              "({identical})."),
        run=ddp_equals_one_process,
        checks=(Check("torch's DDP replicas hold the same bits", lambda f: f["torch_identical"]),
                Check("torch's DDP equals one process on the whole batch to float32 rounding (< 1e-5)",
                      lambda f: f["torch_diff"] < 1e-5),
                Check("so do dplab's", lambda f: f["identical"] and f["diff"] < 1e-5)),
        hint="Equal halves: the mean of the two halves' mean gradients is the whole batch's mean gradient.",
        show=("dplab.backends.nn.ddp.DistributedDataParallel.mark_param_as_ready",),
        try_this="torchrun --nproc-per-node 2 -m dplab.backends.cli train --backend torch",
        teaches=("dp-vs-ddp", "allreduce"),
    ),
    Step(
        title="Inside torch's DDP: buckets rebuilt, unused parameters, buffers",
        text=("Li et al. (VLDB 2020) describe what torch's DDP does beyond the all-reduce. Two gloo ranks "
              "and a module that registers its layers c, a, b (`named_parameters()`: {names}) but runs "
              "a → b → c:\n\n"
              "- **Buckets are rebuilt from what backward did.** At construction DDP can only guess the "
              "order in which gradients will be ready: the reverse of the registration order, the first "
              "bucket capped at 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`): here a single bucket of all "
              "{first_bytes:,} bytes. During the first backward it records the order in which gradients "
              "really became ready and rebuilds the buckets from it, once ({cap:,}-byte cap): "
              "**{rebuilt}**. c's gradients are ready first because c ran last, so the first bucket's "
              "all-reduce starts while b and a are still in backward. Every rank rebuilt the same "
              "buckets ({same_on_ranks:yesno}): they must, or an all-reduce would add up different "
              "gradients.\n"
              "- **Unused parameters.** Add a layer the forward never calls: its gradient hook never "
              "fires, its bucket never fills, and the next iteration stops with \"{unused_error}\". "
              "`find_unused_parameters=True` walks the autograd graph after every forward to mark such "
              "parameters ready (here: {find}), a traversal each iteration; `static_graph=True` promises the "
              "graph never changes, so DDP learns the unused set and the hooks' order in the first "
              "iteration and skips the search after (here: {static}).\n"
              "- **Buffers travel every forward.** Parameters are broadcast once, at construction; buffers "
              "(BatchNorm's running statistics, say) are broadcast from rank 0 again at the start of "
              "every forward, by default (`{option}`{renamed}). Rank "
              "0 stamped its buffer 1 and rank 1 its 2: after one forward rank 1 holds {stamp_on:g} by "
              "default and {stamp_off:g} with `{option}=False`."),
        run=inside_ddp,
        checks=(Check("at construction, one bucket holds every parameter", lambda f: f["first_count"] == 1),
                Check("the rebuilt buckets follow backward's order: c, then b, then a",
                      lambda f: [n.split(".")[0] for b in f["rebuilt_lists"] for n in b]
                      == ["c", "c", "b", "b", "a", "a"]),
                Check("every rank rebuilt the same buckets", lambda f: f["same_on_ranks"]),
                Check("by default an unused parameter stops the next iteration",
                      lambda f: "finished reduction" in f["unused_error"]),
                Check("find_unused_parameters=True and static_graph=True both run with it",
                      lambda f: f["find"] == f["static"] == "it ran"),
                Check("by default one forward overwrites rank 1's buffer with rank 0's; switched off, "
                      "rank 1 keeps its own", lambda f: f["stamp_on"] == f["stamp_0"] == 1
                      and f["stamp_off"] == 2)),
        inputs={"cap": CAP},
        predict=Predict("A module registers its layers c, a, b and runs them a → b → c. After the first "
                        "backward, DDP rebuilds its buckets: whose gradients are in the first bucket, "
                        "'a', 'b' or 'c'?", "first_bucket", choices=("a", "b", "c"),
                        misconceptions=(("a", "a runs first in forward, so its gradients are ready last "
                                              "in backward: the rebuilt first bucket holds the last "
                                              "layer's"),)),
        hint="Backward runs the forward in reverse: the last layer's gradients are ready first.",
        hints=("DDP records the order in which the gradient hooks fire during the first backward.",),
        show=(ddp_inside,),
        try_this="In ddp_inside, make the forward skip b on odd iterations: which switch does it need now?",
        teaches=("dp-vs-ddp", "ddp-internals"),
    ),
    Step(
        title="Three engines, one answer",
        text=("The same {steps} steps of ring all-reduce training on two ranks, over three engines - "
              "{engines} - end with the same parameters to the bit ({same_bits}): the schedule fixes "
              "the order of every addition, and the engine only moves bytes. MPI's ranks were started "
              "by mpiexec, gloo's by a fork and a TCP rendezvous, shared memory's by a fork."),
        run=three_engines,
        checks=(Check("all three engines end with identical parameters", lambda f: f["same_bits"]),),
        predict=Predict("Will the three engines end with 'identical' parameters, 'close' ones, or "
                        "'different' ones?", "verdict", choices=("identical", "close", "different")),
        hint="A schedule says who adds which chunk in which round; every engine performs the same adds.",
        show=("dplab.reference.collectives.run_schedule",),
        try_this="dplab compare --backends local,mpi,torch --algorithms ring,native --world-sizes 2,4",
        teaches=("engines",),
    ),
    Step(
        title="Past one machine: the engines' own launchers",
        text=("Nothing above needs to know how its ranks started. Under the engines' launchers the same "
              "command runs on many machines. torch ({torch_engine} here; NCCL on GPUs, which "
              "`DPLAB_DEVICE=cuda` asks for) with one torchrun per node, meeting at node0's c10d rendezvous "
              "under one job id:\n\n{torch_lines}\n\n"
              "and MPI (here {mpi_engine}) from one node, with the hosts and their slots:\n\n{mpi_line}\n\n"
              "These are the lines tests/test_hosts_launchers.py runs across network namespaces (two "
              "hosts on one machine), built by the same functions, with node names for the namespaces' "
              "addresses (`--rdzv-conf is_host` and `--local-addr` are there because every namespace "
              "shares one hostname; on real nodes they are harmless). The launcher sets each rank's "
              "place (MPI's communicator; torchrun's RANK, WORLD_SIZE, MASTER_ADDR); dplab takes its rank "
              "from the engine - here MPI numbered the ranks {mpi_ranks} and torch.distributed "
              "{torch_ranks} - and runs the same schedules."),
        run=who_numbered_the_ranks,
        checks=(Check("dplab's rank r is MPI's rank r", lambda f: f["mpi_ranks"] == [0, 1]),
                Check("and torch.distributed's rank r", lambda f: f["torch_ranks"] == [0, 1]),
                Check("every torchrun line names the c10d rendezvous, one job id, node0, and CUDA",
                      lambda f: all({"--rdzv-backend", "c10d", "--rdzv-id", "job1", "node0:29500",
                                     "DPLAB_DEVICE=cuda"} <= set(a) for a in f["torch_argv"]))),
        hint="`dplab train --help` lists --backend; README 'Three backends, one API' has the launch lines.",
        show=(launch_lines,),
        try_this="mpiexec -n 4 dplab train --backend mpi",
        teaches=("engines",),
    ),
)

LESSON = Lesson(12, "engines", "DataParallel vs DDP, and the engines under them",
                "Why every rank is equal in DDP, and how the same code runs on MPI, gloo and NCCL.", STEPS,
                needs=("torch", "mpi"))
