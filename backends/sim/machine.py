"""This machine as a simulated cluster, calibrated on one process and two ranks, to predict more.

    python -m dplab.backends.sim.machine --out reference/clusters/this-machine.json

The ``this-machine`` preset, every number measured here (with the date and the load in its
sources), on a machine that is usually shared with other work:

- its cores are a pool (``device_pool``): each rank's compute and copies run on whichever core is
  free, as the operating system schedules processes, so p ranks on fewer cores each run p / cores
  times slower while all of them work (and faster while some wait for a message);
- each core's rates are what it keeps while every core works (a rank of a data-parallel run is
  never alone: its peers compute, or spin waiting, on the other cores, and cores share their
  caches, their memory and here, it seems, one physical core), with one BLAS thread as a rank
  runs: the reference MLP's float64 step (``4M``: forward, backward, an SGD step) at batch 64
  and at batch 8 and DDP's torch MLP's float32 step (batch 32), each run in one process per core
  at once and priced by the same operations the simulator charges (``reference.flops``, torch's
  FLOP registry), so one step on one simulated core takes what it took here beside the others.
  The two batches give two rates: FLOPs (the large batch's matmuls) and memory (the small
  batch's step is mostly its weights read, its gradients written and the optimizer's pass, the
  same bytes at any batch: no plain copy, which runs ahead of a step's fresh arrays and strided
  reads, prices them). The same step in one process alone, and the plain matmul rate at each
  model's shape, are recorded beside it;
- the cache a collective's buffers get: the node footprint (every process's buffers) at which a
  ``np.copyto`` in one process per core at once falls halfway from its rate in cache to its rate
  from memory, swept over footprints for about a second; not the kernel's ``cache/index3``
  (recorded beside it), the most there could be: the code, the transport's own data and, on a
  shared chip, other tenants hold part of it, and the simulator's step (``Link.beta_at``) must
  sit where the rate falls, or every size between the two is priced at the wrong rate;
- the link (shared memory, the local backend) in cache as ``dplab tune`` fits it from ``dplab
  bench`` on 2 local ranks, at sizes of ``SIZES`` whose buffers fill under half that cache by the
  simulator's rule (``IN_CACHE``: the fall is gradual, and a cell on it would pull the fitted
  bandwidth toward memory's): one alpha and beta for every schedule, and each of ring, tree,
  direct and native fitted alone (gamma folded into beta), because the transport runs them
  differently (native is the one-shot: one round of descriptors; tree's messages are whole
  buffers); a message is the receiving core's copy, queued with its compute;
- past the cache: the rate at which a message of a collective whose buffers fill the cache moves
  its bytes: the transport's own, measured by ``dplab bench`` on 2 local ranks at ``PAST_SIZES``
  (the rate at which the simulator on the terms above gives what was measured), not a plain
  copy's: a sum reads two buffers and writes one, and a plain 64 MiB ``np.copyto`` (in one
  process per core at once, recorded beside it) runs well ahead of the transport; that copy's
  rate (2n bytes moved) is a reduction's (``reduce_gb_s``);
- crowded: 2 ranks a core (the local transport's waiting ranks sleep, and the OS wakes each and
  gives it a core, at every message), each algorithm's alpha at which the simulator on the terms
  above gives what ``dplab bench`` measures at ``CROWDED_SIZES``: the sizes of the messages it
  prices (at tens of KiB a crowded rank sleeps at every message and pays more than at 1 MiB).

Every ``dplab bench`` here uses ``BENCH``, the protocol of ``backends/perf/measure_sim.sh`` (the
same reps and statistic as the rows the preset is validated against), and no calibration size is
a validated one.

What it predicts is the rest: 1 to 64 MiB all-reduces at 2 ranks and 4 ranks on the 2 cores,
the reference recipe's and DDP's steps on 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure", "main"]

MIB = 1 << 20
# Calibration sizes: none is a size the preset is validated at (1, 4, 16, 64 MiB)
SMALL_BATCH = 8  # the float64 step's second batch (64 the first): none a validated row's batch
SIZES = ("64K", "256K", "512K", "1536K", "2M", "3M", "6M", "12M")  # in-cache fit's candidates
IN_CACHE = 0.5  # an in-cache size's footprint at most half the cache: clear of the rate's fall
PAST_SIZES = "32M,128M"  # 2 ranks' buffers 2 and 8 times the kernel's L3: every copy from memory
CROWDED_SIZES = "512K,2M"  # 2 ranks a core, at the sizes of the messages it prices
# The protocol of backends/perf/measure_sim.sh: each cell the median of 5 loops of 0.1 s in each
# of 3 worlds (4 ranks on 2 cores: one world's times can differ twofold from the next one's)
BENCH = ("--reps", "5", "--target-seconds", "0.5", "--worlds", "3")
ALGORITHMS = ("ring", "tree", "direct", "native")


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


Ops = list[tuple[float, float]]  # (FLOPs, bytes) of each operation of a step


def _priced(ops: Ops, rate: float, memory: float, overhead: float) -> float:
    """Seconds of ``ops`` on the simulator's roofline (``Setup.compute_seconds``): FLOPs at
    ``rate``, bytes at ``memory`` a second, at least ``overhead`` seconds each."""
    return sum(max(f / rate, n / memory, overhead) for f, n in ops)


def _bisect(too_high: Any, lo: float, hi: float) -> float:
    """Where in [lo, hi] the monotone ``too_high`` turns true, bisected on a log scale."""
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if too_high(mid) else (mid, hi)
    return (lo * hi) ** 0.5


def _rate(ops: Ops, seconds: float, memory: float, overhead: float) -> float:
    """The FLOP rate at which ``ops`` take ``seconds`` (bytes at ``memory``)."""
    return _bisect(lambda rate: _priced(ops, rate, memory, overhead) < seconds, 1e6, 1e15)


def _rates(large: tuple[Ops, float], small: tuple[Ops, float],
           overhead: float) -> tuple[float, float]:
    """(FLOP/s, memory bytes/s) at which both steps, each (ops, seconds), take their seconds: for
    each memory rate the FLOP rate that prices the ``large`` batch's step right, and the memory
    rate at which the ``small`` batch's step (mostly bytes) comes out right too."""

    def small_too_fast(memory: float) -> bool:
        rate = _rate(*large, memory, overhead)
        return _priced(small[0], rate, memory, overhead) < small[1]

    memory = _bisect(small_too_fast, 1e8, 1e12)
    return _rate(*large, memory, overhead), memory


def _median(fn: Any, reps: int = 7) -> float:
    """The median seconds of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _together(fn: Any, cores: int) -> list[Any]:
    """``fn(ready)`` in ``cores`` forked processes at once (each calls ``ready()`` when set up,
    and all start timing together): what each returned, in process order."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, pipes = ctx.Barrier(cores), [ctx.Pipe(duplex=False) for _ in range(cores)]

    def run(out: Any) -> None:
        out.send(fn(start.wait))
        out.close()

    procs = [ctx.Process(target=run, args=(w,)) for _, w in pipes]
    for p in procs:
        p.start()
    results = [r.recv() for r, _ in pipes]
    for p in procs:
        p.join()
    return results


def _copy(ready: Any = None, nbytes: int = 64 * MIB, seconds: float = 0.5) -> float:
    """Seconds per ``np.copyto`` of ``nbytes`` (float64): the mean over a window of ``seconds``
    (processes started together copy side by side for all of it, none alone at the end)."""
    x, y = np.ones(nbytes // 8), np.zeros(nbytes // 8)
    np.copyto(x, y)
    if ready is not None:
        ready()
    n, t0 = 0, time.perf_counter()
    while (took := time.perf_counter() - t0) < seconds:
        np.copyto(x, y)
        n += 1
    return took / n


def _mlp_step(ready: Any = None, batch: int = 64) -> tuple[float, list[tuple[float, float]]]:
    """Seconds per step of the reference MLP ``4M`` (float64, one process: forward, backward, an
    SGD step; the median of 7), and the operations the simulator charges for it; ``ready()``, if
    given, is called before timing."""
    from dplab.backends.cli.scaling import MODELS
    from dplab.reference.flops import backward_ops, forward_ops, loss_ops, optimizer_ops
    from dplab.reference.model import MLP
    from dplab.reference.optim import OptimConfig, make_optimizer

    m = MODELS["4M"]
    model = MLP(m)
    params, grad = model.init_params(0), np.zeros(model.num_params)
    opt = make_optimizer(OptimConfig(), model.num_params)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, m.in_dim)), rng.standard_normal((batch, m.out_dim))

    def step() -> None:
        grad[:] = 0
        model.loss_and_grad(params, x, y, 1 / batch, grad)
        opt.step(params, grad)

    step()
    if ready is not None:
        ready()
    seconds = _median(step)
    layers = range(model.num_layers)
    ops = [op for i in layers for op in forward_ops(m, i, batch, 8)] + loss_ops(m, batch, 8)
    ops += [op for i in reversed(layers) for op in backward_ops(m, i, batch, 8)]
    ops += optimizer_ops("sgd", model.num_params, 8)
    return seconds, ops


def _ddp_step(ready: Any = None) -> tuple[float, list[tuple[float, float]]]:
    """Seconds per step of DDP's torch MLP on one process (batch 32), and its operations' FLOPs and
    bytes as ``TorchClock`` counts them; ``ready()``, if given, is called before timing."""
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

    step()
    if ready is not None:
        ready()
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


def _matmul_rates() -> dict[str, float]:
    """FLOP/s of one thread's plain matmul at each model's widest shape: float64 (NumPy) 64 x
    1536 by 1536 x 1536 (the MLP 4M, batch 64), float32 (torch) 32 x 2048 by 2048 x 2048 (DDP's
    MLP, batch 32)."""
    import torch

    a, b, out = np.ones((64, 1536)), np.ones((1536, 1536)), np.empty((64, 1536))
    f64 = 2 * 64 * 1536 * 1536 / _best(lambda: np.matmul(a, b, out=out))
    x, w = torch.ones(32, 2048), torch.ones(2048, 2048)
    f32 = 2 * 32 * 2048 * 2048 / _best(lambda: torch.mm(x, w))
    return {"float64": f64, "float32": f32}


_CACHE = "/sys/devices/system/cpu/cpu0/cache/index{}/size"  # 2: a core's L2, 3: the L3 (lscpu's)


def _cache_bytes(index: int = 3) -> int:
    """A cache's size in bytes as the kernel reports it (``cache/index3``: the last level, index2:
    a core's L2; this machine's 32 MiB and 512 KiB if it reports none)."""
    try:
        text = Path(_CACHE.format(index)).read_text().strip()
    except OSError:
        return {2: MIB // 2}.get(index, 32 * MIB)
    scale = {"K": 1 << 10, "M": MIB, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


def _footprints(l3: int, l2: int, cores: int) -> list[int]:
    """The copy sweep's node footprints, steps of sqrt 2: from past the cores' own caches (twice
    their L2s, or a sixteenth of the L3 if more) to four times the L3, far past any share of it."""
    lo = max(l3 / 16, 2 * l2 * cores)
    steps = round(2 * np.log2(4 * max(l3, lo) / lo)) + 1
    return [int(lo * 2 ** (k / 2)) // 4096 * 4096 for k in range(steps)]


def _copy_rates(footprints: list[int], cores: int, seconds: float = 0.02) -> list[float]:
    """Bytes a second (read and written) of one process's ``np.copyto`` at each node footprint,
    in one process per core at once, each copying ``footprint / cores`` (its source and its
    destination), every window of ``seconds`` started together: the median process's, each the
    fastest of 3 windows (another process given the core slows a window, never speeds one)."""

    def sweep(ready: Any) -> list[float]:
        return [min(_copy(ready, f // cores // 2, seconds) for _ in range(3)) for f in footprints]

    each = _together(sweep, cores)
    return [f / cores / _mid([s[i] for s in each]) for i, f in enumerate(footprints)]


def _fall(footprints: list[int], rates: list[float]) -> float:
    """The cache a copy sees: the footprint at which its rate falls halfway from in cache (the
    fastest) to from memory (the median of the three largest footprints'), where a step (the
    simulator's ``Link.beta_at``) is off by at most half the fall on either side. Past the last
    footprint whose rate is at or above that midpoint (a cell in cache that noise slowed does not
    end the cache), interpolated on the footprints' log scale; the largest footprint if the rate
    never falls.

    Args:
        footprints: node footprints in bytes, ascending, the last three well past the cache.
        rates: a copy's rate at each (any unit).

    Returns:
        The footprint in bytes at which the cache ends.
    """
    fast, slow = max(rates), _mid(rates[-3:])
    half = (fast + slow) / 2
    i = max(k for k, r in enumerate(rates) if r >= half)
    if i == len(rates) - 1:
        return float(footprints[-1])
    t = (rates[i] - half) / (rates[i] - rates[i + 1])
    return float(footprints[i] * (footprints[i + 1] / footprints[i]) ** t)


def _link_sizes(cache: float, ranks: int = 2) -> str:
    """``SIZES`` the in-cache fit uses: the two smallest (where alpha shows) and the two largest
    whose collective on ``ranks`` ranks stays within ``IN_CACHE`` of ``cache`` by the simulator's
    rule (``Link.beta_at``: every rank's buffer on the node), where beta shows."""
    from dplab.backends.bench.timing import parse_size

    within = [s for s in SIZES if ranks * parse_size(s) < IN_CACHE * cache]
    return ",".join(dict.fromkeys([*SIZES[:2], *within[-2:]]))


def _mid(values: list[float]) -> float:
    """The median of ``values`` (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def _fit(rows: list[dict[str, Any]], by: tuple[str, ...]) -> Any:
    """``dplab tune``'s least-squares fit (relative error, as tune fits) of ``rows``."""
    from dplab.reference.costfit import fit

    return fit(rows, by=by, gamma=False)


def _bench(ranks: int, sizes: str) -> list[dict[str, Any]]:
    """``dplab bench`` on ``ranks`` local ranks at ``sizes``, every algorithm, with the protocol of
    ``backends/perf/measure_sim.sh`` (``BENCH``: the same reps and the same statistic, the
    median, as the rows the preset is validated against), run as the rows are: a command of its
    own. Ranks forked from this process (torch loaded, the steps' arrays held) measured 4 ranks
    on 2 cores 1.5-2.3 times slower than the same bench from a fresh one (512 KiB ring, 07:50 UTC,
    quiet: 1.9 ms against 0.82)."""
    with tempfile.TemporaryDirectory(prefix="dplab-calibrate-") as tmp:
        out = Path(tmp) / "bench.json"
        argv = ["bench", "--backends", "local", "--world-sizes", str(ranks), "--sizes", sizes,
                "--algorithms", ",".join(ALGORITHMS), *BENCH, "--json", str(out)]
        subprocess.run([sys.executable, "-c", _DPLAB, *argv], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


_DPLAB = "import sys; from dplab.backends.cli.commands import main; sys.exit(main(sys.argv[1:]))"


def _link(sizes: str) -> tuple[float, float, dict[str, tuple[float, float, float]]]:
    """(alpha s, beta s/B) of 2 local ranks for every schedule, and per algorithm (alpha, beta,
    rms residual), as ``dplab tune`` fits them from ``dplab bench`` at ``sizes``."""
    rows = _bench(2, sizes)
    schedules = [r for r in rows if r["algorithm"] != "native"]  # native: a one-shot of its own
    f = _fit(schedules, ("backend",))[0]
    if f.alpha is None or not f.beta:  # the sizes' times did not grow with their bytes
        raise SystemExit(f"python -m dplab.backends.sim.machine: the link's fit at {sizes} found "
                         "no price per byte (the machine was too busy to measure it): measure "
                         "when `uptime` shows a load below 1")
    each = {}
    for g in _fit(rows, ("backend", "world_size", "algorithm")):
        if g.alpha is not None and g.beta:  # a fit the rows pinned down, with a price per byte
            each[g.algorithm] = (g.alpha, g.beta, g.summary()["rms_residual_pct"] / 100)
    return f.alpha, f.beta, each


def _measured(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) of each algorithm's cells in ``dplab bench`` rows."""
    measured: dict[str, list] = {}
    for r in rows:
        if r["algorithm"] in ALGORITHMS:
            measured.setdefault(r["algorithm"], []).append((r["bytes"], r["time_us"] * 1e-6))
    return measured


def _solve(preset: dict[str, Any], ranks: int, measured: dict[str, list[tuple[int, float]]],
           term: Any, lo: float, hi: float) -> dict[str, float]:
    """Each algorithm's value of one term of ``preset`` at which the simulator gives what was
    measured: for every cell, the value (by bisection between ``lo`` and ``hi``) at which
    ``collective_time`` on ``preset`` with ``term(doc, algorithm, value)`` applied equals the
    measured seconds; then their geometric mean over the algorithm's sizes. A term whose larger
    values make a collective slower (an alpha) starts from ``lo`` = 0 and halves linearly; a rate
    (``lo`` > 0: larger is faster) halves geometrically."""
    from dplab.backends.sim.timing import collective_time
    from dplab.reference.cluster import cluster_from_dict

    def simulated(algorithm: str, value: float, nbytes: int) -> float:
        doc = json.loads(json.dumps(preset))
        term(doc, algorithm, value)
        return collective_time(cluster_from_dict(doc), ranks, algorithm, nbytes).seconds

    rate = lo > 0
    values = {}
    for algorithm, cells in measured.items():
        found = []
        for nbytes, seconds in cells:
            a, b = lo, hi
            for _ in range(40):
                mid = (a * b) ** 0.5 if rate else (a + b) / 2
                too_fast = simulated(algorithm, mid, nbytes) < seconds  # at mid
                a, b = (a, mid) if too_fast == rate else (mid, b)
            found.append(max((a * b) ** 0.5 if rate else b, 1e-9))
        values[algorithm] = float(np.exp(np.mean(np.log(found))))
    return values


def _past_cache(preset: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, list]]:
    """The transport's rate past the cache (bytes of a message a second): ``dplab bench`` on 2
    local ranks at ``PAST_SIZES``, then the ``past_cache_gb_s`` at which the simulator on
    ``preset`` gives each measured time, the geometric mean over sizes and algorithms; each
    algorithm's, and the measured seconds by algorithm."""
    def term(doc: dict[str, Any], algorithm: str, value: float) -> None:
        doc["links"]["intra"]["past_cache_gb_s"] = value / 1e9

    measured = _measured(_bench(2, PAST_SIZES))
    each = _solve(preset, 2, measured, term, 1e8, 1e12)
    rate = float(np.exp(np.mean(np.log(list(each.values())))))
    return rate, each, {k: [t for _, t in cells] for k, cells in measured.items()}


def _crowded(preset: dict[str, Any], ranks: int) -> tuple[dict[str, float], dict[str, list]]:
    """Each algorithm's alpha while ``ranks`` local ranks share fewer cores: ``dplab bench`` at
    ``CROWDED_SIZES``, then the alpha at which the simulator on ``preset`` gives each measured time
    (by bisection), their geometric mean; and the measured seconds by algorithm."""
    def term(doc: dict[str, Any], algorithm: str, value: float) -> None:
        doc["links"]["intra"]["crowded_alpha_us"] = {algorithm: value * 1e6}

    measured = _measured(_bench(ranks, CROWDED_SIZES))
    alphas = _solve(preset, ranks, measured, term, 0.0, 0.1)
    return alphas, {k: [t for _, t in cells] for k, cells in measured.items()}


def measure() -> dict[str, Any]:
    """The ``this-machine`` cluster, measured now (about a minute on two cores).

    Returns:
        The preset file's dictionary (``reference/clusters/this-machine.json``), every number
        with its source, date and load in ``sources``.
    """
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    from dplab.backends.launch.serve import one_thread_per_rank

    load_before = os.getloadavg()[0]
    one_thread_per_rank()  # as a rank computes: one BLAS thread (and torch's) per process
    alone_copy = _copy()
    small = np.zeros(4)
    op_s = _best(lambda: np.add(small, small, out=small), inner=2000)
    matmul = _matmul_rates()
    mlp_alone, mlp_ops = _mlp_step()
    ddp_alone, ddp_ops = _ddp_step()
    # every core at work, as in a data-parallel run: the median process of each
    copy_s = _mid(_together(_copy, cores))
    moved_s = 2 * 64 * MIB / copy_s
    mlp_s = _mid([t for t, _ in _together(_mlp_step, cores)])
    small_s, small_ops = _mid(_together(lambda ready: _mlp_step(ready, SMALL_BATCH), cores))
    ddp_s = _mid([t for t, _ in _together(_ddp_step, cores)])
    l3 = _cache_bytes(3)
    footprints = _footprints(l3, _cache_bytes(2), cores)
    copy_rates = _copy_rates(footprints, cores)
    cache = _fall(footprints, copy_rates)
    f64, memory_s = _rates((mlp_ops, mlp_s), (small_ops, small_s), op_s)
    rates = {"float64": f64, "float32": _rate(ddp_ops, ddp_s, memory_s, op_s)}
    sizes = _link_sizes(cache)
    alpha, beta, each = _link(sizes)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    preset = {
        "name": "this-machine",
        "nodes": 1,
        "ranks_per_node": 64,
        "devices_per_node": cores,
        "device_pool": True,
        "device": {
            "name": f"one of {cores} cores ({os.uname().machine})",
            "tflop_s": {k: round(v / 1e12, 6) for k, v in rates.items()},
            "memory_gb": round(memory / 1e9, 1),
            "memory_gb_s": round(memory_s / 1e9, 3),
            "op_overhead_us": round(op_s * 1e6, 3),
        },
        "links": {
            "intra": {
                "name": "shared memory (the local backend)",
                "alpha_us": round(alpha * 1e6, 2),
                "bandwidth_gb_s": round(1 / beta / 1e9, 3),
                "on_device": True,
                "cache_mib": round(cache / MIB, 3),
                "past_cache_gb_s": round(64 * MIB / copy_s / 1e9, 3),  # until measured below
                "algorithms": {
                    k: {"alpha_us": round(a * 1e6, 2), "bandwidth_gb_s": round(1 / b / 1e9, 3)}
                    for k, (a, b, _) in sorted(each.items())
                },
            }
        },
        "reduce_gb_s": round(moved_s / 1e9, 3),
    }
    past, past_each, past_measured = _past_cache(preset)
    preset["links"]["intra"]["past_cache_gb_s"] = round(past / 1e9, 3)
    crowded, measured = _crowded(preset, 2 * cores)
    preset["links"]["intra"]["crowded_alpha_us"] = {
        k: round(a * 1e6, 2) for k, a in sorted(crowded.items())}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return preset | {
        "sources": [
            f"measured by python -m dplab.backends.sim.machine on {when}: load average "
            f"{load_before:.2f} before, {load} (1, 5, 15 min) after, {cores} cores, "
            f"Python {sys.version.split()[0]}",
            f"cores: a pool (device_pool), each rank's compute and copies on whichever core is "
            f"free, as the OS schedules {cores} cores among processes; every rate below is what "
            f"one process gets while each of the {cores} cores runs one (the median process)",
            f"float64: the reference MLP 4M (512-1536-1536-512), one BLAS thread, "
            f"{mlp_s * 1e3:.1f} ms a step at batch 64 and {small_s * 1e3:.1f} ms at batch "
            f"{SMALL_BATCH} in each of {cores} processes at once "
            f"({mlp_alone * 1e3:.1f} ms at batch 64 in one process alone; forward, backward, SGD; "
            "the median of 7), which the simulator's operations of a step take at "
            f"{rates['float64'] / 1e9:.2f} GFLOP/s and {memory_s / 1e9:.2f} GB/s from memory "
            "(memory_gb_s; both steps at once: the small batch's is mostly its weights, "
            "gradients and the optimizer's pass) (a plain 64x1536 @ 1536x1536 matmul "
            f"alone: {matmul['float64'] / 1e9:.2f} GFLOP/s, best of 7)",
            f"float32: DDP's torch MLP (512-2048-2048-2048-512), batch 32, one thread, "
            f"{ddp_s * 1e3:.1f} ms a step in each of {cores} processes at once "
            f"({ddp_alone * 1e3:.1f} ms alone; the median of 7), which torch's operations take at "
            f"{rates['float32'] / 1e9:.2f} GFLOP/s at float64's memory rate (a plain 32x2048 @ "
            "2048x2048 matmul alone: "
            f"{matmul['float32'] / 1e9:.2f} GFLOP/s, best of 7)",
            f"memory: a 64 MiB np.copyto in each of {cores} processes at once, "
            f"{moved_s / 1e9:.2f} GB/s moved (read and write, the mean over 0.5 s; "
            f"{2 * 64 * MIB / alone_copy / 1e9:.2f} GB/s alone; reduce_gb_s); a 4-element np.add "
            f"{op_s * 1e6:.2f} us (op_overhead_us)",
            f"cache: {cache / MIB:.2f} MiB (cache_mib), the node footprint at which a "
            f"np.copyto in each of {cores} processes at once (each its share of the footprint: "
            "source and destination) falls halfway from its rate in cache (the fastest) to its "
            "rate from memory (the median of the 3 largest footprints), the sweep in GB/s moved "
            "by each process: "
            + ", ".join(f"{f / MIB:.3g} MiB {r / 1e9:.1f}" for f, r in zip(footprints, copy_rates))
            + f"; the kernel's last-level cache: {l3 / MIB:g} MiB ({_CACHE.format(3)}), the most "
            "a collective's buffers could have (the code, the transport's own data and other "
            "tenants of the chip use it too)",
            "past the cache: a collective "
            "whose buffers on the node fill it moves each byte of a message at the transport's "
            f"own rate from memory: dplab bench on 2 local ranks at {PAST_SIZES} "
            f"({' '.join(BENCH)}), the rate at which the simulator on the terms here gives what "
            f"was measured, {past / 1e9:.3f} GB/s (past_cache_gb_s, the geometric mean over sizes "
            "and algorithms: "
            + "; ".join(f"{k} {past_each[k] / 1e9:.2f} GB/s from "
                        f"{', '.join(f'{t * 1e6:.0f}' for t in ts)} us measured"
                        for k, ts in sorted(past_measured.items()))
            + f"), below the plain copy's {64 * MIB / copy_s / 1e9:.3f} GB/s with every core "
            "copying (a sum reads two buffers and writes one; the peer's pages are shared)",
            f"link: dplab tune's fit (least squares on relative error, gamma folded into beta) "
            f"of dplab bench on 2 local ranks ({sizes}: of {','.join(SIZES)}, the two smallest "
            f"and the two largest whose 2 buffers fill under {IN_CACHE:g} of the cache; "
            f"{' '.join(BENCH)}): ring, tree and direct "
            f"together, alpha {alpha * 1e6:.1f} us, beta 1/{1 / beta / 1e9:.3f} GB/s; each "
            "algorithm alone (links.intra.algorithms, tune's per-algorithm level): "
            + "; ".join(f"{k} alpha {a * 1e6:.1f} us, 1/{1 / b / 1e9:.3f} GB/s, rms residual "
                        f"{res:.0%}" for k, (a, b, res) in sorted(each.items()))
            + "; a message is its receiver's copy (or sum) out of the sender's shared memory, "
            "on the receiver's core",
            f"crowded: {2 * cores} local ranks on the {cores} cores (a waiting rank sleeps, the "
            f"OS wakes it and gives it a core), dplab bench at {CROWDED_SIZES} "
            f"({' '.join(BENCH)}): each "
            "algorithm's alpha (crowded_alpha_us) is the one at which the simulator on the terms "
            "above gives what was measured (the geometric mean over sizes): "
            + "; ".join(f"{k} {', '.join(f'{t * 1e6:.0f}' for t in ts)} us measured"
                        for k, ts in sorted(measured.items())),
        ],
        "note": "Measured on a shared virtual machine: rerun on a quiet machine, or on yours.",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m dplab.backends.sim.machine [--out FILE]``: measure, then print or write.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).

    Returns:
        0, once the preset is written.
    """
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
