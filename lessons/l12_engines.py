"""Lesson 12: DataParallel against DistributedDataParallel, and the engines under them.

    dplab lesson 12              # needs the torch and mpi extras: pip install -e ".[all]"

Four steps: a master that gathers every gradient and scatters every weight (what torch's
single-process DataParallel does) against an all-reduce where no rank is special; DDP for a torch
module, equal to one process on the whole batch; one training run on MPI, gloo and shared memory
ending in the same bits; and the launchers that take the same code past one machine.
"""

from __future__ import annotations

import numpy as np

from dplab.backends import allreduce
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

__all__ = ["LESSON"]


def bytes_sent(comm, n, algorithm):
    """(bytes this rank sent, bytes it sent to rank 0) in one
    all-reduce of n float32 values."""
    grad = np.ones(n, dtype=np.float32)
    comm.tracer.enabled = True
    allreduce(comm, grad, algorithm=algorithm)
    comm.tracer.enabled = False
    sends = [e for e in comm.tracer.take() if e.kind == "send"]
    to_master = [e for e in sends if e.peer == 0]
    return sum(e.bytes for e in sends), sum(e.bytes for e in to_master)


def a_master_against_a_ring(lab):
    # a million bytes of float32 gradient
    n, p = 250_000, 4
    world = lab.world(p)
    naive = world.run(bytes_sent, n, "naive")
    master_sent = naive[0][0]
    master_received = sum(to_master for _, to_master in naive[1:])
    ring_sent = world.run(bytes_sent, n, "ring")[0][0]
    return {"n_bytes": 4 * n, "p": p,
            "master_sent": master_sent,
            "master_received": master_received,
            "ring_sent": ring_sent,
            "ratio": master_sent / ring_sent}


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


def ddp_equals_one_process(lab):
    steps, batch = 10, 64
    # (imports torch before the ranks fork)
    alone = train_torch(None, steps, batch)
    replicas = lab.world(2).run(train_torch, steps, batch)
    first = replicas[0]
    return {"identical": all(np.array_equal(r, first) for r in replicas),
            "steps": steps, "batch": batch,
            "diff": float(np.abs(first - alone).max()),
            "params": len(alone)}


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


def who_numbered_the_ranks(lab):
    mpi, gloo = lab.world(2, "mpi"), lab.world(2, "torch")
    return {"mpi_engine": mpi.run(engine_name)[0],
            "torch_engine": gloo.run(engine_name)[0],
            "mpi_ranks": mpi.run(engine_rank),
            "torch_ranks": gloo.run(engine_rank)}


STEPS = (
    Step(
        title="DataParallel: one process and a master",
        text=("torch's `nn.DataParallel` runs in one process: each step the master device scatters the "
              "inputs, copies the weights to every other device, and sums every gradient back onto "
              "itself. That is the **naive** all-reduce: for {n_bytes:,} bytes of gradient at p={p}, the "
              "master (rank 0) receives {master_received:,} bytes and sends {master_sent:,}. In a **ring** "
              "(DistributedDataParallel's default in NCCL) every rank sends {ring_sent:,}: the master "
              "carries **{ratio:g}x** as much, and the gap grows as p/2 - besides the one Python "
              "process driving every device."),
        run=a_master_against_a_ring,
        checks=(Check("the master sends and receives (p-1)·n bytes",
                      lambda f: f["master_sent"] == f["master_received"] == (f["p"] - 1) * f["n_bytes"]),
                Check("a ring rank sends 2(p-1)/p·n bytes",
                      lambda f: f["ring_sent"] == 2 * (f["p"] - 1) * f["n_bytes"] // f["p"]),
                Check("the master carries p/2 times a ring rank's bytes",
                      lambda f: f["ratio"] == f["p"] / 2)),
        predict=Predict("At p={p}, how many times more bytes does the master send than one rank of a ring?",
                        "ratio", rel_tol=1e-9),
        hint="Master: (p-1)·n out. Ring: 2(p-1)/p·n out. Divide.",
        try_this="dplab compare --algorithms naive,ring --world-sizes 2,4,8",
        explore=Explore("collectives", lambda f: {"algorithm": "naive", "p": f["p"]}),
        teaches=("dp-vs-ddp", "allreduce"),
    ),
    Step(
        title="DistributedDataParallel: a process per rank, nobody in the middle",
        text=("`DistributedDataParallel` (here dplab's, `backends/nn/ddp.py`, torch's API) wraps a torch "
              "module in each of 2 processes. Backward hooks all-reduce the gradients in buckets and "
              "average them, so {steps} SGD steps on each rank's half of a {batch}-sample batch end where "
              "one process on all {batch} ends: {diff:.1e} apart ({params} parameters, float32), and the two "
              "replicas are identical (`{identical}`)."),
        run=ddp_equals_one_process,
        checks=(Check("the replicas hold the same bits", lambda f: f["identical"]),
                Check("DDP equals one process on the whole batch to float32 rounding (< 1e-5)",
                      lambda f: f["diff"] < 1e-5)),
        hint="Equal halves: the mean of the two halves' mean gradients is the whole batch's mean gradient.",
        try_this="torchrun --nproc-per-node 2 -m dplab.backends.cli train --backend torch",
        teaches=("dp-vs-ddp",),
    ),
    Step(
        title="Three engines, one answer",
        text=("The same {steps} steps of ring all-reduce training on two ranks, over three engines - "
              "{engines} - end with the same parameters to the bit (`{same_bits}`): the schedule fixes "
              "the order of every addition, and the engine only moves bytes. MPI's ranks were started "
              "by mpiexec, gloo's by a fork and a TCP rendezvous, shared memory's by a fork."),
        run=three_engines,
        checks=(Check("all three engines end with identical parameters", lambda f: f["same_bits"]),),
        predict=Predict("Will the three engines end with 'identical' parameters, 'close' ones, or "
                        "'different' ones?", "verdict", choices=("identical", "close", "different")),
        hint="A schedule says who adds which chunk in which round; every engine performs the same adds.",
        try_this="dplab compare --backends local,mpi,torch --algorithms ring,native --world-sizes 2,4",
        teaches=("engines",),
    ),
    Step(
        title="Past one machine: the engines' own launchers",
        text=("Nothing above needs to know how its ranks started. Under the engines' launchers the same "
              "command runs on many machines: MPI (here {mpi_engine}) with a host file,\n\n"
              "    mpiexec -n 16 -f hosts dplab train --backend mpi\n\n"
              "and torch ({torch_engine}; NCCL on GPUs) with one torchrun per node,\n\n"
              "    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29500 \\\n"
              "        -m dplab.backends.cli train --backend torch\n\n"
              "The launcher sets each rank's place (MPI's communicator; torchrun's RANK, WORLD_SIZE, "
              "MASTER_ADDR); dplab takes its rank from the engine - here MPI numbered the ranks {mpi_ranks} "
              "and torch.distributed {torch_ranks} - and runs the same schedules."),
        run=who_numbered_the_ranks,
        checks=(Check("dplab's rank r is MPI's rank r", lambda f: f["mpi_ranks"] == [0, 1]),
                Check("and torch.distributed's rank r", lambda f: f["torch_ranks"] == [0, 1])),
        hint="`dplab train --help` lists --backend; README 'Three backends, one API' has the launch lines.",
        try_this="mpiexec -n 4 dplab train --backend mpi",
        teaches=("engines",),
    ),
)

LESSON = Lesson(12, "engines", "DataParallel vs DDP, and the engines under them",
                "Why every rank is equal in DDP, and how the same code runs on MPI, gloo and NCCL.", STEPS,
                needs=("torch", "mpi"))
