"""The simulator against measurements: the rows of backends/PERFORMANCE.md's validation tables.

    python -m dplab.backends.sim.validate published --out backends/perf/validation_published.json
    python -m dplab.backends.sim.validate gpu --out backends/perf/validation_gpu.json
    python -m dplab.backends.sim.validate machine backends/perf/machine_*.json --out ...
    python -m dplab.backends.sim.validate closed --out backends/perf/validation_closed.json
    python -m dplab.backends.sim.validate speed --out backends/perf/sim_speed.json

Each row is one comparison: what the simulator predicts (run now, on a preset) beside what was
measured (a row file of this machine's, a number of the GPU check in PERFORMANCE.md's notes, or a
published figure, cited), with its unit and source. ``perf_tables`` renders them with each error
(predicted / measured - 1) and their geometric mean (exp of the mean |log ratio|, minus 1).

- published: nccl-tests on DGX H100 (one node, two nodes), and a published data-parallel scaling
  result (Goyal et al. 2017: ResNet-50, 8 to 256 P100s), reproduced in shape;
- gpu: the cuda backend on one H200 as ``bash tests/gpu/check.sh`` measured it;
- machine: this machine's ``dplab bench``, ``scaling`` and ``scaling --ddp`` rows
  (``backends/perf/measure_sim.sh``);
- closed: the simulator against the closed-form cost model on a cluster without contention;
- speed: how fast the simulator is (events per second), for item 5 of issue 30.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["published", "gpu", "machine", "closed", "speed", "resnet50_stages", "main"]

GIB, MIB = 1 << 30, 1 << 20

SJEAUGEY = (
    "https://github.com/NVIDIA/nccl-tests/issues/212, a comment of NCCL's maintainer S. Jeaugey "
    "(2024-05-06) on 8 H100 SXM on NVLink4: NCCL reaches an effective NVLink bandwidth of about "
    "370 GB/s (the 450 GB/s line rate less ~20% protocol overhead), which all_reduce_perf shows as "
    "busbw with NCCL_ALGO=RING"
)
ADDYLADDY = (
    "https://github.com/NVIDIA/nccl-tests/issues/290, NVIDIA's reply (AddyLaddy, 2025-03-03) on "
    "H100 nodes over NDR InfiniBand, benchmarked across two nodes with NCCL_ALGO=RING: 46-48 GB/s "
    "per 400 Gb/s NIC is what to expect (47 taken)"
)
GOYAL = (
    "Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour, arXiv:1706.02677 "
    "(2017): ResNet-50, 32 images per GPU, Big Basin servers of 8 P100 on NVLink with one 50 Gbit "
    "Ethernet NIC each; about 90% scaling efficiency from 8 to 256 GPUs (abstract); "
    "backpropagation on one P100 takes 120 ms (section 4). Simulated: those 120 ms spread over "
    "ResNet-50's stages by their multiply-adds, the forward taken as half of it (the paper does "
    "not say), 25 MiB buckets, hierarchical:8 (as their three-phase all-reduce: within servers, "
    "between, within)"
)
CHECK = (
    "tests/gpu/check.sh on a lent H200 (torch 2.11), backends/PERFORMANCE.md, notes: 'The cuda "
    "backend on one GPU'"
)


def resnet50_stages() -> list[tuple[int, int]]:
    """(parameters, multiply-adds at 224 x 224) of ResNet-50's stem, four stages and head, from its
    layer shapes (bottlenecks of 1x1, 3x3, 1x1 convolutions; 3, 4, 6, 3 blocks): 25,557,032
    parameters and 4.09 G multiply-adds, as torchvision counts them."""
    stages = [(7 * 7 * 3 * 64 + 2 * 64, 7 * 7 * 3 * 64 * 112 * 112)]
    inp, hw = 64, 56
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        params = macs = 0
        for b in range(blocks):
            out = hw // (stride if b == 0 else 1)
            convs = [(inp * width, hw), (9 * width * width, out), (width * 4 * width, out)]
            if b == 0:
                convs.append((inp * 4 * width, out))  # the shortcut's projection
            params += sum(p for p, _ in convs) + 2 * (6 * width + (4 * width if b == 0 else 0))
            macs += sum(p * s * s for p, s in convs)
            inp, hw = 4 * width, out
        stages.append((params, macs))
    stages.append((2048 * 1000 + 1000, 2048 * 1000))
    return stages


def _row(
    check: str, cluster: str, predicted: float, measured: float, unit: str, source: str, **more: Any
) -> dict[str, Any]:
    return {
        "check": check,
        "cluster": cluster,
        "predicted": predicted,
        "measured": measured,
        "unit": unit,
        "source": source,
        **more,
    }


def published() -> list[dict[str, Any]]:
    """(c): DGX H100's ring busbw on one node and two, and Goyal et al.'s scaling efficiency."""
    from dplab.backends.sim.timing import bench_rows, ddp_step_time

    rows = []
    one = next(
        r for r in bench_rows(_c("dgx-h100"), 8, ["ring"], [GIB]) if r["algorithm"] == "ring"
    )
    rows.append(
        _row(
            "ring all-reduce busbw, 1 GiB, 8 GPUs (NCCL_ALGO=RING)",
            "dgx-h100",
            one["busbw_gbps"],
            370.0,
            "GB/s",
            SJEAUGEY,
        )
    )
    two = next(
        r for r in bench_rows(_c("dgx-h100x2"), 16, ["ring"], [8 * GIB]) if r["algorithm"] == "ring"
    )
    rows.append(
        _row(
            "ring all-reduce busbw, 8 GiB, 2 nodes x 8 GPUs (NCCL_ALGO=RING)",
            "dgx-h100x2",
            two["busbw_gbps"],
            47.0,
            "GB/s",
            ADDYLADDY,
        )
    )
    stages = resnet50_stages()
    total = sum(m for _, m in stages)
    layers = [(p, 0.060 * m / total, 0.120 * m / total) for p, m in stages]
    step_s = (
        5 * 4 * sum(p for p, _ in stages) / 732e9
    )  # momentum SGD: 5 passes over float32 weights
    times = {
        p: ddp_step_time(
            f"big-basin-p100x{p // 8}", p, layers, 25.0, "hierarchical:8", 4, step_s
        ).seconds
        for p in (8, 256)
    }
    rows.append(
        _row(
            "ResNet-50 weak scaling, 8 to 256 GPUs: efficiency t(8) / t(256)",
            "big-basin-p100x32",
            times[8] / times[256],
            0.90,
            "",
            GOYAL,
            detail=f"simulated step {times[8] * 1e3:.1f} ms on 8 GPUs, "
            f"{times[256] * 1e3:.1f} ms on 256",
        )
    )
    return rows


def gpu() -> list[dict[str, Any]]:
    """(b): the cuda backend's rows of the GPU check on one H200 against the ``h200`` preset."""
    from dplab.backends.launch.world import launch
    from dplab.backends.sim.timing import collective_time

    n, copy_bw = 256 * MIB, 4.10e12  # the check's buffer and its device copy (read + write)
    measured = {
        2: 340e-6,
        4: 2.9 * 15 * n / copy_bw,
        8: 6.5 * 35 * n / copy_bw,
    }  # x the floor 5n(p-1)
    rows = []
    for p, t in measured.items():
        rows.append(
            _row(
                f"cuda backend, ring all-reduce of 256 MiB float32, {p} ranks on one GPU",
                "h200",
                collective_time(_c("h200"), p, "ring", n).seconds * 1e6,
                t * 1e6,
                "µs",
                CHECK
                + (
                    " (340 us)"
                    if p == 2
                    else f" ({'2.9' if p == 4 else '6.5'}x the floor 5n(p-1) at 4.10 TB/s)"
                ),
            )
        )
    for p, ms in ((2, 3.56), (4, 12.2)):
        predicted = max(launch(_ddp_on_gpu, p, backend="sim", cluster="h200"))
        rows.append(
            _row(
                "cuda backend, our DDP step: 3 x Linear(2048, 2048), batch 256, "
                f"{p} ranks on one GPU",
                "h200",
                predicted * 1e3,
                ms,
                "ms",
                CHECK,
            )
        )
    return rows


def _ddp_on_gpu(comm: Any) -> float:
    """tests/gpu/cuda_rows.py's DDP job on this rank: seconds per step (10 timed after 3)."""
    import torch
    from torch import nn

    from dplab.backends.nn.ddp import DDP

    g = torch.Generator().manual_seed(0)
    width, batch = 2048, 256 // comm.world_size
    model = nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
    )
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * 0.01)
    model = DDP(model, comm, bucket_cap_mb=25, algorithm="ring")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    comm.barrier()
    t0 = comm.now()
    for _ in range(10):
        step()
    took = (comm.now() - t0) / 10
    model.close()
    return took


def machine(paths: list[str]) -> list[dict[str, Any]]:
    """(a): this machine's measured rows (bench, scaling, scaling --ddp) beside the same commands on
    the ``this-machine`` preset.

    Args:
        paths: the measured row files (``dplab ... --json``, stamped with their date and load).

    Returns:
        Validation rows: check, cluster, predicted, measured, unit, and the source (the file, its
        command, when it was measured and under what load); rows of one process computing alone
        (``drift``: the kind of step the calibration timed, timed again with the rows) say
        whether the machine ran as fast as when it was calibrated, and are not validation.

    Raises:
        RuntimeError: the same command on the preset failed.
    """
    from dplab.backends.cli.commands import main as dplab

    rows: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta, measured = data["meta"], data["rows"]
        argv = _as_sim(meta["argv"])
        out = Path(path).with_suffix(".sim.json")
        if dplab([*argv, "--json", str(out)]) != 0:
            raise RuntimeError(f"dplab {' '.join(argv)} failed")
        predicted = json.loads(out.read_text())["rows"]
        out.unlink()
        source = f"{Path(path).name}: dplab {' '.join(_drop_json(meta['argv']))}{_load(meta)}"
        rows += _pairs(meta["command"], measured, predicted, source)
    return rows


def _load(meta: dict[str, Any]) -> str:
    """When a measured file was measured, and under what load (``perf.tables stamp``)."""
    m = meta.get("measured", {})
    if "date" not in m:
        return ""
    before = f"{m['load_before']:g} before, " if "load_before" in m else ""
    return f" (measured {m['date']}, load average {before}{m['load_average'][0]:g} after)"


def _as_sim(argv: list[str]) -> list[str]:
    """The measuring command's arguments, on the sim backend and the ``this-machine`` preset."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--json", "--reps"):
            skip = True
            continue
        if a in ("--backends", "--backend"):
            out += [a, "sim"]
            skip = True
            continue
        out.append(a)
    return [*out, "--cluster", "this-machine", "--reps", "1"]


def _drop_json(argv: list[str]) -> list[str]:
    i = argv.index("--json") if "--json" in argv else len(argv)
    return argv[:i] + argv[i + 2 :]


def _pairs(command: str, measured: list[dict], predicted: list[dict], source: str) -> list[dict]:
    """Measured and predicted rows of one command matched by what they measure."""
    rows = []
    if command == "bench":
        sim = {(r["algorithm"], r["world_size"], r["bytes"]): r for r in predicted}
        for r in measured:
            if r["algorithm"] == "memcpy" or r["bytes"] < MIB:
                continue
            p = sim[(r["algorithm"], r["world_size"], r["bytes"])]
            rows.append(
                _row(
                    f"local bench, {r['algorithm']}, p={r['world_size']}, {r['bytes'] >> 20} MiB",
                    "this-machine",
                    p["time_us"],
                    r["time_us"],
                    "µs",
                    source,
                )
            )
    elif predicted and "impl" in predicted[0]:  # scaling --ddp
        sim = {(r["impl"], r["world_size"]): r for r in predicted}
        alone = {r["global_batch"]: r for r in predicted if r["impl"] == "single"}
        for r in measured:
            if r["impl"] == "single":  # the calibration's float32 step, timed again in this run
                rows.append(
                    _row(
                        f"DDP's MLP in one process, batch {r['global_batch']}",
                        "this-machine",
                        alone[r["global_batch"]]["step_ms"],
                        r["step_ms"],
                        "ms",
                        source,
                        drift=True,
                    )
                )
            if r["impl"] == "dplab":
                p = sim[("dplab", r["world_size"])]
                rows.append(
                    _row(
                        f"DDP step, 10.5 M-parameter MLP, batch 64, p={r['world_size']}",
                        "this-machine",
                        p["step_ms"],
                        r["step_ms"],
                        "ms",
                        source,
                    )
                )
    else:  # scaling: the reference recipe's step
        sim = {(r["model"], r["world_size"]): r for r in predicted}
        for r in measured:
            if r["world_size"] == 1:  # compute alone: the calibration's float64 step's kind
                rows.append(
                    _row(
                        f"train step, MLP {r['model']}, batch 64, one process",
                        "this-machine",
                        sim[(r["model"], 1)]["step_ms"],
                        r["step_ms"],
                        "ms",
                        source,
                        drift=True,
                    )
                )
            if r["world_size"] > 1:
                p = sim[(r["model"], r["world_size"])]
                rows.append(
                    _row(
                        f"train step, MLP {r['model']}, batch 64, p={r['world_size']}",
                        "this-machine",
                        p["step_ms"],
                        r["step_ms"],
                        "ms",
                        source,
                    )
                )
    return rows


def closed() -> list[dict[str, Any]]:
    """(d): the simulator against the cost model, 64 MiB on 16 ranks of 2 DGX H100 nodes."""
    from dplab.backends.sim.timing import collective_time
    from dplab.reference.algorithms import allreduce_schedule
    from dplab.reference.costmodel import cost
    from dplab.reference.topology import Topology

    c, p, n = _c("dgx-h100x2"), 16, 64 * MIB
    rows = []
    for alg in (
        "ring",
        "direct",
        "naive",
        "recursive_doubling",
        "rabenseifner",
        "tree",
        "hierarchical:8",
    ):
        model = cost(allreduce_schedule(alg, p), n, itemsize=4, topology=Topology.of(c)).time
        rows.append(
            _row(
                f"{alg}, 64 MiB, 16 ranks",
                c.name,
                collective_time(c, p, alg, n).seconds * 1e6,
                model * 1e6,
                "µs",
                "dplab.reference.costmodel.cost on the same cluster (its "
                "Topology.of): a port per rank, no contention",
            )
        )
    return rows


def speed() -> list[dict[str, Any]]:
    """Item 5: a timing-only ring at p = 1,024 and a DDP step at p = 64 (threads), timed here."""
    from dplab.backends.cli.scaling_ddp import DdpBench, ddp_rank
    from dplab.backends.launch.world import World
    from dplab.backends.sim.timing import collective_time

    ring = collective_time("dgx-h100x128", 1024, "ring", GIB)
    rows = [
        {
            "what": "timing-only ring all-reduce, 1 GiB, p = 1,024 (dgx-h100x128)",
            "wall_s": ring.wall_s,
            "events": ring.events,
            "events_per_s": ring.events / ring.wall_s,
            "simulated_s": ring.seconds,
        }
    ]
    cfg = DdpBench(steps=1, warmup=0)
    with World(64, "sim", cluster="dgx-h100x8") as world:
        world.run(_nothing)
        engine_events = world.run(_events)[0]
        t0 = time.perf_counter()
        step = max(t for t, _ in world.run(ddp_rank, cfg, "dplab"))
        wall = time.perf_counter() - t0
        events = world.run(_events)[0] - engine_events
    rows.append(
        {
            "what": "DDP step, 10.5 M-parameter MLP, batch 64, p = 64 (dgx-h100x8), rank "
            "threads with real data (the model built, one step)",
            "wall_s": wall,
            "events": events,
            "events_per_s": events / wall,
            "simulated_s": step,
        }
    )
    return rows


def _nothing(comm: Any) -> None:
    return None


def _events(comm: Any) -> int:
    return comm.world.engine.tasks_done


def _c(name: str) -> Any:
    from dplab.reference.cluster import cluster

    return cluster(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["published", "gpu", "machine", "closed", "speed"])
    parser.add_argument("rows", nargs="*", help="machine: the measured row files")
    parser.add_argument("--out", required=True, help="the validation rows to write")
    a = parser.parse_args(argv)
    before = round(os.getloadavg()[0], 2)
    rows = machine(a.rows) if a.what == "machine" else globals()[a.what]()
    meta = {
        "command": "validate",
        "what": a.what,
        "argv": sys.argv[1:] if argv is None else argv,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "measured": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "load_before": before,
            "cpus": os.cpu_count(),
        },
    }
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
