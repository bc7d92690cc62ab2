"""DDP's speed, measured: our DDP at world size p against one process on the 1/p batch, and torch's
DDP.

    dplab scaling --ddp --backends local,mpi,torch --reps 3

    ratio = step(DDP, p ranks, B/p each) / step(1 process, B/p)

is the price of data parallelism: 1.0 is free. Cells (single, ours on each backend, torch's DDP
over gloo, single, ...) are interleaved in worlds alive for the whole run and report the median
repetition, so ratios are taken within one run. Each rank runs one thread; a cell's time is the
slowest rank's mean step over ``steps`` steps after ``warmup`` untimed ones, with no barrier
inside the loop.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from dplab.backends.registry import entry
from dplab.backends.sim.setup import resolve_cluster
from dplab.reference.errors import ConfigError

__all__ = ["DdpBench", "ddp_rank", "ddp_model", "DDP_COLUMNS", "ddp_rows", "run_ddp"]

DDP_COLUMNS = ["impl", "backend", "world_size", "params", "global_batch", "step_ms",
               "ratio_vs_single", "cpu_ms", "cpu_ratio_vs_single", "load_1min"]
IMPLS = ("single", "independent", "dplab", "torch_ddp")


@dataclass(frozen=True)
class DdpBench:
    """The DDP measurement: torch's MLP ``in_dim -> hidden... -> out_dim``, SGD, global
    batch split."""

    in_dim: int = 512
    hidden: tuple[int, ...] = (2048, 2048, 2048)  # 10.5 M parameters with 512 in and out
    out_dim: int = 512
    global_batch: int = 64
    steps: int = 5
    warmup: int = 2
    bucket_cap_mb: float = 25.0  # torch DDP's default
    algorithm: str = "ring"
    lr: float = 0.01
    cluster: str | None = None  # backend "sim": the simulated cluster its worlds run on

    def validate(self, world_size: int) -> None:
        if self.global_batch < world_size:
            raise ConfigError(f"global batch {self.global_batch} < world size {world_size}: "
                              "every rank needs a sample; raise --global-batch")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError("the DDP measurement needs --steps >= 1 and --warmup >= 0")

    def params(self) -> int:
        dims = [self.in_dim, *self.hidden, self.out_dim]
        return sum(a * b + b for a, b in zip(dims, dims[1:]))


def ddp_model(cfg: DdpBench, seed: int = 0) -> Any:
    """The MLP of the measurement (ReLU between layers), float32, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    dims = [cfg.in_dim, *cfg.hidden, cfg.out_dim]
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def ddp_rank(comm: Any, cfg: DdpBench, impl: str) -> tuple[float, float] | None:
    """Runs on every rank: this rank's mean step, wall and CPU seconds (None where it sits out).

    CPU time counts every thread of the rank's process (the comm thread, gloo's): the work a step
    costs, which a busy machine inflates much less than the wall time.

    ``single``: rank 0 alone trains on the 1/p batch, the others return at once (and sleep).
    ``independent``: every rank trains alone on its 1/p batch, no communication: what p processes
    computing at once cost on this machine (shared caches, memory bandwidth, cores), DDP's real
    floor. ``dplab``: our ``DistributedDataParallel`` on ``comm``. ``torch_ddp``: torch's own, over
    the process group of the torch backend (gloo on CPU).
    """
    import torch
    from torch import nn

    torch.set_num_threads(1)
    if impl == "single" and comm.rank != 0:
        return None
    p = comm.world_size
    local = cfg.global_batch // p
    model = ddp_model(cfg)
    if impl == "dplab":
        from dplab.backends.nn.ddp import DDP

        model = DDP(model, comm, bucket_cap_mb=cfg.bucket_cap_mb, algorithm=cfg.algorithm)
    elif impl == "torch_ddp":
        group = getattr(comm, "_group", None)
        if group is None:
            raise ConfigError("torch's DDP runs on the torch backend only")
        model = nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=cfg.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(1 + comm.rank)
    x, y = torch.randn(local, cfg.in_dim, generator=g), torch.randn(local, cfg.out_dim, generator=g)

    def step() -> None:
        opt.zero_grad()  # torch's default: set_to_none=True
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    try:
        for _ in range(cfg.warmup):
            step()
        if impl != "single":
            comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(cfg.steps):
            step()
        return (time.perf_counter() - t0) / cfg.steps, (time.process_time() - c0) / cfg.steps
    finally:
        if impl == "dplab":
            model.close()


def ddp_rows(times: dict[tuple[str, str], list[tuple[float, float]]], cfg: DdpBench,
             world_size: int, load: float | None = None) -> list[dict[str, Any]]:
    """Rows from ``{(impl, backend): [(slowest rank's wall step, mean rank's CPU step) per rep]}``:
    medians over repetitions, and ratios against ``single`` (wall to wall, CPU to CPU)."""
    wall = {key: statistics.median(w for w, _ in ts) for key, ts in times.items()}
    cpu = {key: statistics.median(c for _, c in ts) for key, ts in times.items()}
    base = next((key for key in times if key[0] == "single"), None)
    rows = []
    for (impl, backend), t in wall.items():
        single = impl == "single"
        rows.append({"impl": impl, "backend": "-" if impl == "independent" else backend,
                     "world_size": 1 if single else world_size, "params": cfg.params(),
                     "global_batch": cfg.global_batch // world_size if single else cfg.global_batch,
                     "step_ms": t * 1e3, "ratio_vs_single": t / wall[base] if base else None,
                     "cpu_ms": cpu[impl, backend] * 1e3,
                     "cpu_ratio_vs_single": cpu[impl, backend] / cpu[base] if base else None,
                     "reps": len(times[impl, backend]), "load_1min": load,
                     "step_ms_each": [w * 1e3 for w, _ in times[impl, backend]]})
    return rows


def run_ddp(cfg: DdpBench, backends: list[str], world_sizes: list[int],
            reps: int) -> list[dict[str, Any]]:
    """Per world size: one process on the 1/p batch (in the first backend's world, its other ranks
    idle), our DDP on every backend and torch's DDP on the torch backend,
    interleaved ``reps`` times."""
    from dplab.backends.cli.table import Progress
    from dplab.backends.launch.world import World

    for p in world_sizes:
        cfg.validate(p)
    rows: list[dict[str, Any]] = []
    cells = ([("single", backends[0]), ("independent", backends[0])]
             + [("dplab", b) for b in backends])
    cells += [("torch_ddp", "torch")] if "torch" in backends else []
    progress = Progress(len(world_sizes) * reps * len(cells))
    for p in world_sizes:
        worlds: dict[str, Any] = {}
        times: dict[tuple[str, str], list[tuple[float, float]]] = {c: [] for c in cells}
        loads = []
        try:
            for b in backends:
                simulated = entry(b).simulated
                worlds[b] = World(p, b, cluster=resolve_cluster(cfg.cluster) if simulated else None)
            for _ in range(reps):
                for impl, b in cells:
                    per_rank = worlds[b].run(ddp_rank, cfg, impl)
                    mine = [t for t in per_rank if t is not None]
                    times[impl, b].append((max(w for w, _ in mine),
                                           statistics.fmean(c for _, c in mine)))
                    loads.append(os.getloadavg()[0])
                    progress.step(f"{impl} {b} p={p}")
        finally:
            for w in worlds.values():
                w.close()
        rows += ddp_rows(times, cfg, p, statistics.fmean(loads))
    progress.close()
    for r in rows:  # a simulated cell's time is its cluster's: say which
        if r["backend"] != "-" and entry(r["backend"]).simulated:
            c = resolve_cluster(cfg.cluster)
            r |= {"cluster": c.name, "clock": "simulated", "cluster_about": c.describe()}
    return rows
