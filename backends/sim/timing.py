"""Timing-only runs: a collective's schedule alone, on the same engine and ports, to p = 1,024.

    from dplab.backends.sim.timing import collective_time
    r = collective_time("dgx-h100x128", 1024, "ring", 1 << 30)    # 1 GiB on 1,024 H100s
    r.seconds, r.events, r.events / r.wall_s                  # its time, and the simulator's speed

Rank threads cost tens of microseconds a hand-off: a ring at p = 1,024 is 2 x 1,023 rounds of 1,024
transfers, 2.1 million of them. Here the schedule is the program: each rank is a step actor that
posts its messages of a round (sizes, no bytes), waits for them, spends gamma on what it reduced,
and goes on; the engine, the ports and the pricing are the rank threads' own, so a timing-only
collective takes exactly the time the same collective takes with real data (a test holds them
equal).
Large schedules come from the engine's array builders (``dplab.backends.fastpath.arrays``), the
rest from the readable ones.
"""

from __future__ import annotations

import gc
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAY_BUILDERS
from dplab.backends.sim.engine import BLOCKED, Actor, Task
from dplab.backends.sim.setup import SimWorld, resolve_cluster
from dplab.reference.algorithms import ALLREDUCE as READABLE
from dplab.reference.algorithms import ROOTED, allreduce_schedule, lookup, split_name
from dplab.reference.cluster import Cluster
from dplab.reference.columns import RoundTable, columns
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, chunk_bounds
from dplab.reference.topology import Topology
from dplab.reference.train.buckets import assign_buckets

__all__ = ["TimingResult", "collective_time", "schedule_time", "ddp_step_time",
           "data_parallel_step_time", "bench_rows", "table_of", "NATIVE"]

NATIVE = "direct"  # the sim's native all-reduce is the one-shot: the direct schedule's two rounds


@dataclass(frozen=True)
class TimingResult:
    """``seconds`` of simulated time; ``events``: transfers and compute tasks the engine ran;
    ``wall_s``: how long the simulator took."""

    seconds: float
    events: int
    wall_s: float


def table_of(algorithm: str, world_size: int) -> RoundTable:
    """The all-reduce schedule of ``algorithm`` at ``world_size`` as columns: the array builder
    where the engine has one (p = 1,024 in a second), else the readable schedule's columns."""
    name = NATIVE if algorithm == "native" else algorithm
    base = split_name(name)[0]
    if base not in READABLE:
        raise ConfigError(
            f"no schedule for all-reduce algorithm {algorithm!r}: choose one of "
            f"{', '.join(READABLE)} or native"
        )
    if base in ARRAY_BUILDERS:
        _, extra = lookup(READABLE, name, "all-reduce")
        return ARRAY_BUILDERS[base](world_size, *extra)
    return columns(allreduce_schedule(name, world_size))


def _messages(table: RoundTable, chunk_bytes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every message of every round as the executor cuts them (``schedule.messages``: per round and
    (src, dst, op), each run of consecutive chunks), in order of their first transfer: (round, src,
    dst, bytes, reduce)."""
    p, out = table.world_size, []
    for r0, r1 in table.blocks():
        a, b = int(table.starts[r0]), int(table.starts[r1])
        if b == a:
            continue
        rid = table.round_ids(r0, r1) + r0
        src, dst = table.src[a:b].astype(np.int64), table.dst[a:b].astype(np.int64)
        chunk, red = table.chunk[a:b].astype(np.int64), table.reduce[a:b]
        order = np.lexsort((chunk, red, dst, src, rid))
        group = ((rid * p + src) * p + dst) * 2 + red
        g, c = group[order], chunk[order]
        new = np.r_[True, (g[1:] != g[:-1]) | (c[1:] != c[:-1] + 1)]
        ids = np.empty(b - a, np.int64)
        ids[order] = np.cumsum(new) - 1
        first = np.full(int(ids.max()) + 1, b - a, np.int64)
        np.minimum.at(first, ids, np.arange(b - a))
        size = np.bincount(ids, chunk_bytes[chunk], minlength=first.size).astype(np.int64)
        by_first = np.argsort(first, kind="stable")
        head = first[by_first]
        out.append((rid[head], src[head], dst[head], size[by_first], red[head]))
    if not out:
        return tuple(np.zeros(0, np.int64) for _ in range(5))
    return tuple(np.concatenate([o[i] for o in out]) for i in range(5))


def _by(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices grouped by ``keys`` (0..n-1, stable) and the offsets of each key's group."""
    order = np.argsort(keys, kind="stable")
    return order, np.searchsorted(keys[order], np.arange(n + 1))


class _Collective:
    """One all-reduce of ``nbytes`` from its schedule: every message, and each rank's rounds to post
    (``rounds``). ``actors[r]``: the actor that runs rank r's part (woken when its messages are
    through)."""

    def __init__(self, world: SimWorld, table: RoundTable, nbytes: int, itemsize: int,
                 actors: list[Actor], algorithm: str = "") -> None:
        bounds = chunk_bounds(nbytes // itemsize, table.num_chunks)
        chunk_bytes = np.array([(hi - lo) * itemsize for lo, hi in bounds], np.int64)
        rnd, src, dst, size, red = _messages(table, chunk_bytes)
        p, self.count = table.world_size, len(table)
        # compact arrays, not lists: 2 M messages at p = 1,024 stay in tens of MB (and in cache)
        self.s_order, self.s_at = (array("q", a) for a in _by(rnd * p + src, self.count * p))
        self.r_order, self.r_at = (array("q", a) for a in _by(rnd * p + dst, self.count * p))
        self.src, self.dst, self.size = array("q", src), array("q", dst), array("q", size)
        self.red = array("b", red.astype(np.int8))
        self.world, self.actors, self.p, self.algorithm = world, actors, p, algorithm
        self.buffer = nbytes  # each rank's: the link's cache sees every rank's on the node
        self.posted = array("d", [-1.0]) * len(self.src)  # each message's first post time, or -1

    def _done(self, m: int, end: float) -> None:  # message m is through: both ranks may go on
        for r in (self.src[m], self.dst[m]):
            a = self.actors[r]
            a.pending -= 1
            if a.pending == 0:
                self.world.engine.wake(a, end)

    def _post(self, m: int, t: float) -> None:  # one side of message m; the second queues it
        first = self.posted[m]
        if first < 0:
            self.posted[m] = t
            return
        src, dst, net = self.src[m], self.dst[m], self.world.network
        net.transfer(src, dst, self.size[m], max(first, t), (dst - src) % self.p,
                     partial(self._done, m), self.algorithm, self.buffer * net.node_ranks[dst])

    def rounds(self, actor: Actor) -> Iterator[None]:
        """Rank ``actor.rank``'s part, round by round; yields while it waits."""
        world, r, p, post = self.world, actor.rank, self.p, self._post
        s_order, s_at, r_order, r_at, size, red = (self.s_order, self.s_at, self.r_order, self.r_at,
                                                   self.size, self.red)
        for k in range(self.count):
            if actor.debt:
                yield from _spend(world, actor)
            i, t = k * p + r, actor.time
            into = r_order[r_at[i]:r_at[i + 1]]
            mine = s_order[s_at[i]:s_at[i + 1]] + into
            if not mine:
                continue
            actor.pending = len(mine)
            for m in mine:
                post(m, t)
            actor.state = BLOCKED
            yield  # woken by _done when the last of them is through
            reduced = sum(size[m] for m in into if red[m])
            if reduced:
                world.reduced(actor, r, reduced, self.algorithm)
        if actor.debt:
            yield from _spend(world, actor)


def _spend(world: SimWorld, actor: Actor) -> Iterator[None]:
    """A step actor spends its compute debt (on a device of its own: at once, no queue)."""
    if not actor.debt:
        return
    if world.exclusive[actor.rank] and actor.key[1] == 0:
        actor.time += actor.debt
        actor.debt = 0.0
        return
    world.engine.flush(actor)
    if actor.busy is not None:
        actor.wake_at, actor.state = actor.time, BLOCKED
        yield


def _run(world: SimWorld, programs: dict[Actor, Iterator[None]], t0: float) -> TimingResult:
    """Drive ``programs`` (one per step actor) to their ends; the result's seconds are set later."""
    for actor, program in programs.items():
        actor.step = partial(_advance, program)  # one round per call, run in place
        world.engine.ready(actor, 0.0)
    gc.disable()  # millions of short-lived tasks: the cycle collector would rescan the big tables
    try:
        world.engine.run()
    finally:
        gc.enable()
    return TimingResult(0.0, world.engine.tasks_done, time.perf_counter() - t0)


def collective_time(c: Cluster | str, world_size: int, algorithm: str, nbytes: int,
                    itemsize: int = 4) -> TimingResult:
    """Simulated seconds of one all-reduce of ``nbytes`` (``nbytes // itemsize`` elements) by
    ``algorithm`` on ``world_size`` ranks of cluster ``c``, from its schedule alone.

    Args:
        c: the cluster, or a preset's name (``dplab.reference.cluster.cluster``).
        world_size: ranks taking part; at most the cluster's size.
        algorithm: an all-reduce schedule's name, or "native" (the one-shot: direct's rounds,
            priced by the link's terms for native where it has some).
        nbytes: the buffer's size; itemsize: one element's.

    Returns:
        ``TimingResult``: the simulated seconds, the engine's events and the wall time taken.

    Raises:
        ConfigError: an unknown cluster or algorithm, or a world larger than the cluster.
    """
    return schedule_time(c, table_of(algorithm, world_size), nbytes, itemsize, algorithm)


def schedule_time(c: Cluster | str, schedule: Schedule | RoundTable, nbytes: int,
                  itemsize: int = 4, algorithm: str = "") -> TimingResult:
    """Simulated seconds of any schedule (a part of one, several rings at once) on a buffer of
    ``nbytes`` on cluster ``c``, timing only: ``collective_time`` without the name.

    Args:
        c: the cluster, or a preset's name.
        schedule: the schedule, or its round table.
        nbytes: the buffer's size; itemsize: one element's.
        algorithm: the all-reduce it is, where the cluster's links price one otherwise ("" if
            none).

    Returns:
        ``TimingResult``: the simulated seconds, the engine's events and the wall time taken.

    Raises:
        ConfigError: an unknown cluster, or a world larger than the cluster.
    """
    table = schedule if isinstance(schedule, RoundTable) else columns(schedule)
    world_size = table.world_size
    world = SimWorld(resolve_cluster(c), world_size, 60.0, ranks=False)
    t0 = time.perf_counter()
    actors = [world.engine.add(Actor((r, 0), main=False)) for r in range(world_size)]
    plan = _Collective(world, table, nbytes, itemsize, actors, algorithm)
    result = _run(world, {a: plan.rounds(a) for a in actors}, t0)
    return replace(result, seconds=max(max(a.time for a in actors), world.engine.now))


def ddp_step_time(c: Cluster | str, world_size: int, layers: list[tuple[int, float, float]],
                  bucket_cap_mb: float = 25.0, algorithm: str = "ring", itemsize: int = 4,
                  optimizer_s: float = 0.0) -> TimingResult:
    """Simulated seconds of one data-parallel step, timing only: the forward, then each layer's
    backward (``layers``: (parameters, forward seconds, backward seconds), in forward order), each
    bucket of gradients (``assign_buckets``, DDP's rule) all-reduced by a comm actor as soon as its
    layers are done, overlapping the rest of the backward; then the optimizer. For models too large
    to hold p replicas of in this machine's memory (the 256 GPUs of a published scaling result).

    Args:
        c: the cluster, or a preset's name.
        world_size: ranks taking part; at most the cluster's size.
        layers: (parameters, forward seconds, backward seconds) of each layer, in forward order.
        bucket_cap_mb: DDP's bucket cap; algorithm: the all-reduce of each bucket.
        itemsize: bytes per gradient element; optimizer_s: the optimizer step's seconds.

    Returns:
        ``TimingResult`` of the step (the slowest rank's end).

    Raises:
        ConfigError: an unknown cluster or algorithm, or a world larger than the cluster.
    """
    world = SimWorld(resolve_cluster(c), world_size, 60.0, ranks=False)
    t0 = time.perf_counter()
    engine = world.engine
    mains = [engine.add(Actor((r, 0), main=False)) for r in range(world_size)]
    comms = [engine.add(Actor((r, 1), main=False)) for r in range(world_size)]
    offsets = np.cumsum([0] + [n for n, _, _ in layers])
    slices = [slice(int(a), int(b)) for a, b in zip(offsets, offsets[1:])]
    buckets = assign_buckets(slices, itemsize, bucket_cap_mb)
    table = table_of(algorithm, world_size)
    plans = [_Collective(world, table, itemsize * sum(layers[i][0] for i in b), itemsize, comms,
                         algorithm) for b in buckets]
    bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
    ready = [0] * world_size  # buckets ready to reduce, per rank (they launch in order)
    reduced = [0] * world_size  # buckets reduced
    waiting = [False] * world_size  # the main actor waits for its last bucket

    def main(actor: Actor) -> Iterator[None]:
        r = actor.rank
        engine.owe(actor, sum(f for _, f, _ in layers), world.devices[r])
        missing = [len(b) for b in buckets]
        for i in reversed(range(len(layers))):
            engine.owe(actor, layers[i][2], world.devices[r])
            yield from _wait_compute(engine, actor)
            missing[bucket_of[i]] -= 1
            while ready[r] < len(buckets) and missing[ready[r]] == 0:
                ready[r] += 1
                engine.wake(comms[r], actor.time)
        while reduced[r] < len(buckets):
            waiting[r], actor.state = True, BLOCKED
            yield
        waiting[r] = False
        engine.owe(actor, optimizer_s, world.devices[r])
        yield from _wait_compute(engine, actor)

    def comm(actor: Actor) -> Iterator[None]:
        r = actor.rank
        for k, plan in enumerate(plans):
            while ready[r] <= k:
                actor.state = BLOCKED
                yield
            yield from plan.rounds(actor)
            reduced[r] += 1
            if waiting[r]:
                engine.wake(mains[r], actor.time)

    programs = {a: main(a) for a in mains} | {a: comm(a) for a in comms}
    result = _run(world, programs, t0)
    return replace(result, seconds=max(max(a.time for a in mains), world.engine.now))


Ops = list[tuple[float, float]]  # operations as (flops, bytes)


def data_parallel_step_time(c: Cluster | str, world_size: int, units: list[tuple[int, Ops, Ops]],
                            dtype: str = "float32", optimizer_s: float = 0.0) -> TimingResult:
    """Simulated seconds of one step of torch's ``nn.DataParallel`` on ``world_size`` GPUs of one
    node, timing only: one process drives every GPU, so the node's ranks are threads
    (``Cluster.threads``: each operation's launch takes its turn on the one host, the device runs
    it behind). GPU 0 broadcasts the weights (``replicate``), every replica runs its forward and
    backward (``units``: (parameters, forward ops, backward ops) in forward order, ops as
    (flops, bytes)), the gradients are reduced onto GPU 0 once backward is over (``reduce_add``),
    and GPU 0 alone runs the optimizer. Broadcast and reduce are the binomial tree's (NCCL pipelines
    a ring: about n beta where the tree pays lg p n beta); the inputs' scatter and the outputs'
    gather are left out (kilobytes for a language model's tokens)."""
    cl = replace(resolve_cluster(c), threads=True)
    world = SimWorld(cl, world_size, 60.0, ranks=False)
    t0 = time.perf_counter()
    itemsize = np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize  # numpy has no bf16
    engine = world.engine
    actors = [engine.add(Actor((r, 0), main=False)) for r in range(world_size)]
    nbytes = itemsize * sum(n for n, _, _ in units)
    bcast, reduce = (_Collective(world, columns(f(world_size, 0)), nbytes, itemsize, actors)
                     for f in ROOTED["tree"][::-1])

    def replica(actor: Actor) -> Iterator[None]:
        r = actor.rank
        yield from bcast.rounds(actor)
        for ops in [f for _, f, _ in units] + [b for _, _, b in reversed(units)]:
            world.spend(actor, r, ops, dtype)
            yield from _wait_compute(engine, actor)  # the host's turn, then the device's work
        yield from _device_done(world, actor)  # reduce_add follows backward's kernels
        yield from reduce.rounds(actor)
        if r == 0:
            engine.owe(actor, optimizer_s, world.devices[0])
            yield from _wait_compute(engine, actor)

    result = _run(world, {a: replica(a) for a in actors}, t0)
    return replace(result, seconds=max(max(a.time for a in actors), world.engine.now))


def _device_done(world: SimWorld, actor: Actor) -> Iterator[None]:
    """A step actor waits until its device has run what was queued on it (as a stream does)."""
    engine = world.engine
    engine.submit(Task([(world.devices[actor.rank], 0.0)], lambda t: engine.wake(actor, t),
                       (actor.time, engine.order(0, actor.rank))), actor.time)
    actor.state = BLOCKED
    yield


def _wait_compute(engine: Any, actor: Actor) -> Iterator[None]:
    """A step actor spends its debt on its device, queued with its rank's comm actor, and waits."""
    engine.flush(actor)
    if actor.busy is not None:
        actor.wake_at, actor.state = actor.time, BLOCKED
        yield


def bench_rows(
    c: Cluster, world_size: int, algorithms: list[str], sizes: list[int], dtype: str = "float32"
) -> list[dict[str, Any]]:
    """``dplab bench``'s rows on a simulated cluster: each algorithm's time at each size from its
    schedule (``native``: the one-shot; ``auto``: what the cost model picks on this cluster), and
    the memory-copy row a device's copy gives (n bytes read, n written at its memory bandwidth)."""
    from dplab.backends.bench.timing import summarize
    from dplab.reference.auto import choose_on

    itemsize, topology = np.dtype(dtype).itemsize, Topology.of(c)
    cells, copies = [], []
    for nbytes in sizes:
        for alg in algorithms:
            ran = choose_on(topology, world_size, nbytes, itemsize) if alg == "auto" else alg
            seconds = collective_time(c, world_size, ran, nbytes, itemsize).seconds
            cells.append(
                {"algorithm": alg, "bytes": nbytes, "times": np.array([seconds]), "staged_bytes": 0}
                | ({"ran": ran} if alg == "auto" else {})
            )
        copy = 2 * nbytes / c.device.memory_bytes_s
        copies.append(
            {"algorithm": "memcpy", "bytes": nbytes, "times": np.array([copy]), "staged_bytes": 0}
        )
    about = {"cluster": c.name, "clock": "simulated", "cluster_about": c.describe()}
    return [
        row | about
        for row in summarize("sim", world_size, [{"allreduce": cells, "memcpy": copies}])
    ]


def _advance(program: Iterator[None], actor: Actor) -> None:
    """A step actor's step: run its program to its next wait (or its end)."""
    next(program, None)
