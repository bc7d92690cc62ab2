"""This machine as a simulated cluster, calibrated on one process and two ranks, to predict more.

    python -m dplab.backends.sim.machine --out reference/clusters/this-machine.json

The ``this-machine`` preset, every number measured here (with the date and the load in its
sources), on a machine that is usually shared with other work:

- a device per core (``os.sched_getaffinity``); more ranks than cores share them round robin;
- each device's rates are what one process gets: the reference MLP's float64 step (``4M``, batch
  64: forward, backward, an SGD step) and DDP's torch MLP's float32 step (batch 32, one
  process), each priced by the same operations the simulator charges (``reference.flops``,
  torch's FLOP registry), so one step on one simulated core takes what it took here;
- the link (shared memory, the local backend) as ``dplab tune`` fits it: alpha and beta from
  ``dplab bench`` on 2 local ranks, 4 KiB to 64 MiB, every schedule and native (gamma folded into
  beta, as the fit says); a message is the receiving core's copy, queued with its compute;
- memory: a 64 MiB ``np.copyto`` (2n bytes moved), the memory-bound operations' roofline.

What it predicts is the rest: 4 ranks, the same models' steps on 2 and 4 ranks, DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure", "main"]

MIB = 1 << 20
SIZES = "4K,64K,1M,4M,16M,64M"


def _best(fn: Any, reps: int = 7, inner: int = 1) -> float:
    """The least seconds per call of ``fn`` over ``reps`` loops of ``inner`` calls."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def _rate(
    ops: list[tuple[float, float]], seconds: float, memory_bytes_s: float, overhead_s: float
) -> float:
    """The FLOP rate at which the roofline of ``ops`` sums to ``seconds``, by bisection."""

    def priced(rate: float) -> float:
        return sum(max(f / rate, n / memory_bytes_s, overhead_s) for f, n in ops)

    lo, hi = 1e6, 1e15
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if priced(mid) < seconds else (mid, hi)
    return (lo * hi) ** 0.5


def _median(fn: Any, reps: int = 7) -> float:
    """The median seconds of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _mlp_step() -> tuple[float, list[tuple[float, float]]]:
    """Seconds per step of the reference MLP ``4M`` (float64, batch 64, one process: forward,
    backward, an SGD step; the median of 7), and the operations the simulator charges for it."""
    from dplab.backends.cli.scaling import MODELS
    from dplab.reference.flops import backward_ops, forward_ops, loss_ops, optimizer_ops
    from dplab.reference.model import MLP
    from dplab.reference.optim import OptimConfig, make_optimizer

    m, batch = MODELS["4M"], 64
    model = MLP(m)
    params, grad = model.init_params(0), np.zeros(model.num_params)
    opt = make_optimizer(OptimConfig(), model.num_params)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, m.in_dim)), rng.standard_normal((batch, m.out_dim))

    def step() -> None:
        grad[:] = 0
        model.loss_and_grad(params, x, y, 1 / batch, grad)
        opt.step(params, grad)

    seconds = _median(step)
    layers = range(model.num_layers)
    ops = [op for i in layers for op in forward_ops(m, i, batch, 8)] + loss_ops(m, batch, 8)
    ops += [op for i in reversed(layers) for op in backward_ops(m, i, batch, 8)]
    ops += optimizer_ops("sgd", model.num_params, 8)
    return seconds, ops


def _ddp_step() -> tuple[float, list[tuple[float, float]]]:
    """Seconds per step of DDP's torch MLP on one process (batch 32), and its operations' FLOPs and
    bytes as ``TorchClock`` counts them."""
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    from dplab.backends.cli.scaling_ddp import DdpBench, ddp_model

    torch.set_num_threads(1)
    cfg = DdpBench()
    model = ddp_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = torch.randn(32, cfg.in_dim), torch.randn(32, cfg.out_dim)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    seconds = _median(step)
    ops: list[tuple[float, float]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not func.is_view:
                packet = func._overloadpacket
                flops = (
                    flop_registry[packet](*args, **kwargs, out_val=out)
                    if packet in flop_registry
                    else 0
                )
                tensors = [
                    t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
                ]
                ops.append(
                    (float(flops), float(sum(t.numel() * t.element_size() for t in tensors)))
                )
            return out

    with Count():
        step()
    return seconds, ops


def _link() -> tuple[float, float]:
    """(alpha s, beta s/B) of 2 local ranks, as ``dplab tune`` fits them from ``dplab bench``."""
    from dplab.backends.cli.commands import bench_argv
    from dplab.reference.costfit import fit

    rows = bench_argv(
        [
            "--backends",
            "local",
            "--world-sizes",
            "2",
            "--sizes",
            SIZES,
            "--algorithms",
            "ring,tree,direct,native",
            "--reps",
            "3",
            "--target-seconds",
            "0.2",
        ]
    )
    schedules = [r for r in rows if r["algorithm"] != "native"]  # native: a one-shot of its own
    f = next(f for f in fit(schedules, relative=False))  # absolute: the large rows set beta
    beta = f.beta if f.beta else f.gamma  # one per-byte price, whichever the fit put it in
    return f.alpha, beta


def measure() -> dict[str, Any]:
    """The ``this-machine`` cluster, as a preset file's dictionary."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    load_before = os.getloadavg()[0]
    x, y = np.ones(64 * MIB // 8), np.zeros(64 * MIB // 8)
    moved_s = 2 * 64 * MIB / _best(lambda: np.copyto(x, y), reps=9)
    small = np.zeros(4)
    op_s = _best(lambda: np.add(small, small, out=small), inner=2000)
    mlp_s, mlp_ops = _mlp_step()
    ddp_s, ddp_ops = _ddp_step()
    rates = {
        "float64": _rate(mlp_ops, mlp_s, moved_s, op_s),
        "float32": _rate(ddp_ops, ddp_s, moved_s, op_s),
    }
    alpha, beta = _link()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return {
        "name": "this-machine",
        "nodes": 1,
        "ranks_per_node": 64,
        "devices_per_node": cores,
        "device": {
            "name": f"one of {cores} cores ({os.uname().machine})",
            "tflop_s": {k: round(v / 1e12, 6) for k, v in rates.items()},
            "memory_gb": round(memory / 1e9, 1),
            "memory_gb_s": round(moved_s / 1e9, 3),
            "op_overhead_us": round(op_s * 1e6, 3),
        },
        "links": {
            "intra": {
                "name": "shared memory (the local backend)",
                "alpha_us": round(alpha * 1e6, 2),
                "bandwidth_gb_s": round(1 / beta / 1e9, 3),
                "on_device": True,
            }
        },
        "reduce_gb_s": round(moved_s / 1e9, 3),
        "sources": [
            f"measured by python -m dplab.backends.sim.machine on {when}: load average "
            f"{load_before:.2f} before, {load} (1, 5, 15 min) after, {cores} cores, "
            f"Python {sys.version.split()[0]}",
            f"float64: the reference MLP 4M (512-1536-1536-512), batch 64, one process, "
            f"{mlp_s * 1e3:.1f} ms a step (forward, backward, SGD; the median of 7), which the "
            f"simulator's operations of a step take at {rates['float64'] / 1e9:.2f} GFLOP/s",
            f"float32: DDP's torch MLP (512-2048-2048-2048-512), batch 32, one process, "
            f"{ddp_s * 1e3:.1f} ms a step (the median of 7), which torch's operations take at "
            f"{rates['float32'] / 1e9:.2f} GFLOP/s",
            f"memory: a 64 MiB np.copyto, {moved_s / 1e9:.2f} GB/s moved (read and write, best "
            f"of 9); a 4-element np.add {op_s * 1e6:.2f} us (op_overhead_us)",
            f"link: dplab tune's fit (least squares, absolute) of dplab bench on 2 local ranks "
            f"({SIZES}; ring, tree, direct): alpha {alpha * 1e6:.1f} us, beta "
            f"1/{1 / beta / 1e9:.3f} GB/s (gamma folded in); a message is its receiver's copy "
            "out of the sender's shared memory, on the receiver's core",
        ],
        "note": "Measured on a shared virtual machine: rerun on a quiet machine, or on yours.",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="-", help="the preset file to write (default: print it)")
    a = parser.parse_args(argv)
    text = json.dumps(measure(), indent=1) + "\n"
    if a.out == "-":
        print(text, end="")
    else:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
