"""The cuda backend's rows of the GPU check (``tests/gpu/check.py`` runs this in a fresh process:
CUDA must not start in a process before it forks a world). One JSON row per line on stdout.

- train: ``train_sync`` on p = 1, 2, 4, 8 ranks of one GPU, every algorithm, against one device;
- bench: ring at 256 MiB against the device-memory floor (the bytes the schedule reads and writes
  over the device copy's bandwidth, both measured here), and 4 KiB all-reduces per round;
- ddp: our DDP on the cuda backend against torch's DDP over gloo with CUDA tensors (processes),
  the same model (3 x 2048 x 2048, 12.6 M parameters), batch and steps.

    python tests/gpu/cuda_rows.py [--cpu]      # --cpu: the script itself, tried on the CPU
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from dplab.backends.bench.timing import _time_loop

CPU = "--cpu" in sys.argv[1:]


def row(**fields) -> None:
    print(json.dumps(fields), flush=True)


def on_cpu() -> None:
    """Put the cuda backend's ranks on the CPU (as tests/test_cuda_backend.py does)."""
    import dataclasses

    import torch

    from dplab.backends import registry
    from dplab.backends.cuda import setup

    registry.BACKENDS["cuda"] = dataclasses.replace(
        registry.BACKENDS["cuda"], available=lambda: None
    )
    setup._DEVICE_OF = lambda rank: torch.device("cpu")


def job_train(comm, algorithm: str, cfg=None):
    """``train_sync`` on this rank: its parameters, and whether it computed where its communicator
    lives (on a GPU the recipe's weights, data and gradients are torch tensors there: memory was
    allocated)."""
    import torch

    from dplab.reference.train.single import TrainConfig
    from dplab.reference.train.sync import SyncConfig, train_sync

    params = train_sync(
        comm, cfg or TrainConfig(steps=5), SyncConfig(algorithm, bucket_cap_mb=0.002)
    ).params
    return params, comm.device.type != "cuda" or torch.cuda.max_memory_allocated(comm.device) > 0


def train_rows() -> None:
    from dplab.backends.launch.world import World
    from dplab.reference.algorithms import ALGORITHMS
    from dplab.reference.model import MLPConfig
    from dplab.reference.optim import OptimConfig
    from dplab.reference.train.single import TrainConfig, train_single

    want = train_single(TrainConfig(steps=5)).params  # NumPy on the host: no CUDA before the fork
    xent = TrainConfig(steps=5, dataset="classification", optimizer=OptimConfig("adam"),
                       model=MLPConfig(activation="relu", loss="xent"))
    want_xent = train_single(xent).params
    for p in (1, 2, 4, 8):
        worst, bad = 0.0, []
        with World(p, "cuda", timeout=60) as world:
            runs = [(a, None, want) for a in ALGORITHMS] + [
                ("ring xent/relu/adam", xent, want_xent)
            ]
            for name, cfg, reference in runs:
                got = world.run(job_train, name.split()[0], cfg)
                diff = float(np.max(np.abs(got[0][0] - reference)))
                same = all(g.tobytes() == got[0][0].tobytes() for g, _ in got)
                worst = max(worst, diff)
                if diff > 1e-10 or not same or not all(on_gpu for _, on_gpu in got):
                    bad.append(name)
        where = "NumPy: --cpu" if CPU else "torch on the GPU"
        row(check=f"train cuda p={p}, {len(runs)} runs ({where}) vs one device",
            result=f"max |diff| {worst:.1e}" + (f"; off: {bad}" if bad else ""), ok=not bad)


def job_bench(comm, nbytes: int, algorithm: str, iters: int):
    import torch

    n = nbytes // 4
    dev = comm.device
    buf = torch.zeros(n, dtype=torch.float32, device=dev)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    from dplab.backends import allreduce

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def loop(fn, k, together=True):
        fn()
        if together:
            comm.barrier()
        return _time_loop(fn, k, sync)  # the bench's own clock: synchronised, mean over k calls

    reduce = (lambda: comm.native_allreduce(buf, check=False)) if algorithm == "native" \
        else (lambda: allreduce(comm, buf, algorithm))
    times = [loop(reduce, iters) for _ in range(3)]
    comm.barrier()  # every rank's last rounds are done: the copy has the GPU to itself
    copy = loop(lambda: dst.copy_(src), iters, together=False) if comm.rank == 0 else 0.0
    return float(np.median(times)), copy


def bench_rows() -> None:
    from dplab.backends.launch.world import World

    big = (1 << 20) if CPU else (256 << 20)
    for p in (2, 4, 8):
        with World(p, "cuda", timeout=120) as world:
            for algorithm in ("ring", "native"):
                res = world.run(job_bench, big, algorithm, 3 if CPU else 10)
                t = max(r[0] for r in res)
                copy_bw = 2 * big / res[0][1]  # read + write, bytes per second
                # ring and one-shot alike: per chunk, (p - 1) adds (read 2, write 1) and (p - 1)
                # copies
                traffic = 5 * big * (p - 1)
                floor = traffic / copy_bw
                limit = 2.0 if p == 2 else 3.0
                row(check=f"bench cuda {algorithm} p={p} {big >> 20} MiB fp32",
                    result=f"{t * 1e6:,.0f} us; floor {floor * 1e6:,.0f} us ({traffic / big:.0f}n "
                           f"bytes at {copy_bw / 1e12:.2f} TB/s copy) = {t / floor:.2f}x",
                    ok=algorithm != "ring" or t / floor <= limit)
            for algorithm in ("ring", "native"):
                res = world.run(job_bench, 4096, algorithm, 20 if CPU else 200)
                t = max(r[0] for r in res)
                rounds = 2 * (p - 1) if algorithm == "ring" else 1
                row(check=f"bench cuda {algorithm} p={p} 4 KiB",
                    result=f"{t * 1e6:,.1f} us, {t * 1e6 / rounds:,.1f} us per round ({rounds} "
                           "rounds)",
                    ok=algorithm != "ring" or t / rounds <= 20e-6)


def handoff_rows() -> None:
    """The floor of a round when ranks are threads: one thread waking another through a
    ``threading.Condition`` and back, as the hub's inboxes do (no CUDA: the host's part alone)."""
    import threading

    n, turn, conds = 2000, [0], [threading.Condition(), threading.Condition()]

    def side(me: int) -> None:
        for _ in range(n):
            with conds[me]:
                while turn[0] != me:
                    conds[me].wait()
            with conds[1 - me]:
                turn[0] = 1 - me
                conds[1 - me].notify()

    threads = [threading.Thread(target=side, args=(i,)) for i in (0, 1)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row(check="thread hand-off (Condition), beside",
        result=f"{(time.perf_counter() - t0) / (2 * n) * 1e6:.1f} us", ok=True)


DDP_STEPS, DDP_BATCH, WIDTH = 10, 256, 2048


def job_ddp(comm, impl: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = comm.device if impl != "torch_ddp" else torch.device("cpu" if CPU else "cuda", 0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, WIDTH)).to(dev)
    if impl == "dplab":
        from dplab.backends.nn.ddp import DDP

        model = DDP(model, comm, bucket_cap_mb=25, algorithm="ring")
    elif impl == "torch_ddp":
        model = nn.parallel.DistributedDataParallel(
            model, process_group=comm._group, bucket_cap_mb=25
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    local = DDP_BATCH // comm.world_size
    x, y = torch.randn(local, WIDTH, device=dev), torch.randn(local, WIDTH, device=dev)

    def step():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(3):
        step()
    comm.barrier()
    took = _time_loop(step, DDP_STEPS, sync)
    if impl == "dplab":
        model.close()
    return took


def ddp_rows() -> None:
    from dplab.backends.launch.world import launch

    single = launch(job_ddp, 1, backend="cuda", args=("single",), timeout=120)[0]
    row(check="ddp single process, full batch", result=f"{single * 1e3:.2f} ms/step", ok=True)
    for p in (2, 4):
        ours = max(launch(job_ddp, p, backend="cuda", args=("dplab",), timeout=120))
        os.environ["DPLAB_DEVICE"] = "cpu"  # gloo: torch's only way to put several ranks on one GPU
        theirs = max(launch(job_ddp, p, backend="torch", args=("torch_ddp",), timeout=120))
        row(check=f"ddp p={p} on one GPU: ours (cuda) vs torch DDP over gloo",
            result=f"{ours * 1e3:.2f} vs {theirs * 1e3:.2f} ms/step = {theirs / ours:.1f}x faster",
            ok=ours < theirs)


def main() -> None:
    if CPU:
        on_cpu()
    asked = [globals()[a + "_rows"] for a in sys.argv[1:] if not a.startswith("-")]  # e.g. "bench"
    for rows in asked or (handoff_rows, train_rows, bench_rows, ddp_rows):
        try:
            rows()
        except Exception as e:  # one failed row, and go on with the others
            row(check=rows.__name__, result=f"{type(e).__name__}: {e}"[-300:], ok=False)


if __name__ == "__main__":
    main()
