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
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAY_BUILDERS
from dplab.backends.sim.engine import BLOCKED, Actor, Task
from dplab.backends.sim.setup import SimWorld, resolve_cluster
from dplab.reference.algorithms import ALLREDUCE as READABLE
from dplab.reference.algorithms import allreduce_schedule, lookup, split_name
from dplab.reference.cluster import Cluster
from dplab.reference.columns import RoundTable, columns
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.topology import Topology

__all__ = ["TimingResult", "collective_time", "table_of", "NATIVE"]

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


def collective_time(
    c: Cluster | str, world_size: int, algorithm: str, nbytes: int, itemsize: int = 4
) -> TimingResult:
    """Simulated seconds of one all-reduce of ``nbytes`` (``nbytes // itemsize`` elements) by
    ``algorithm`` on ``world_size`` ranks of cluster ``c``, from its schedule alone."""
    world = SimWorld(resolve_cluster(c), world_size, 60.0, ranks=False)
    t0 = time.perf_counter()
    table = table_of(algorithm, world_size)
    n = nbytes // itemsize
    chunk_bytes = np.array(
        [(hi - lo) * itemsize for lo, hi in chunk_bounds(n, table.num_chunks)], np.int64
    )
    rnd, src_a, dst_a, size_a, red_a = _messages(table, chunk_bytes)
    p, rounds = world_size, len(table)
    s_order, s_at = (a.tolist() for a in _by(rnd * p + src_a, rounds * p))
    r_order, r_at = (a.tolist() for a in _by(rnd * p + dst_a, rounds * p))
    src, dst, size, red = src_a.tolist(), dst_a.tolist(), size_a.tolist(), red_a.tolist()
    engine, net, exclusive = world.engine, world.network, world.exclusive
    actors = [engine.add(Actor((r, 0), main=False)) for r in range(p)]
    posted: list[float | None] = [None] * len(src)  # the first side's post time, per message
    ends = [0.0] * p

    def done(m: int, end: float) -> None:  # message m is through: both its ranks may go on
        for r in (src[m], dst[m]):
            a = actors[r]
            a.pending -= 1
            if a.pending == 0:
                engine.wake(a, end)

    def post(m: int, t: float) -> None:  # one side of message m: the second one queues its transfer
        first = posted[m]
        if first is None:
            posted[m] = t
            return
        at = max(first, t)
        engine.submit(
            Task(
                net.holds(src[m], dst[m], size[m]),
                partial(done, m),
                (at, engine.order((dst[m] - src[m]) % p, src[m])),
            ),
            at,
        )

    def program(actor: Actor) -> Iterator[None]:
        r, device, gamma = actor.rank, world.devices[actor.rank], world.gamma[actor.rank]
        for k in range(rounds):
            if actor.debt:
                if exclusive[r]:  # nobody else uses this device: no queue to wait in
                    actor.time += actor.debt
                    actor.debt = 0.0
                else:
                    engine.flush(actor)
                    if actor.busy is not None:
                        actor.wake_at, actor.state = actor.time, BLOCKED
                        yield
            i, t = k * p + r, actor.time
            mine = s_order[s_at[i] : s_at[i + 1]] + r_order[r_at[i] : r_at[i + 1]]
            if not mine:
                continue
            actor.pending = len(mine)
            for m in mine:
                post(m, t)
            actor.state = BLOCKED
            yield  # woken by done() when the last of them is through
            reduced = sum(size[m] for m in r_order[r_at[i] : r_at[i + 1]] if red[m])
            if reduced:
                engine.owe(actor, reduced * gamma, device)
        ends[r] = actor.time + actor.debt

    for actor in actors:
        actor.step = partial(_advance, program(actor))  # one round per call, run in place
        engine.ready(actor, 0.0)
    gc.disable()  # millions of short-lived tasks: the cycle collector would rescan the big tables
    try:
        engine.run()
    finally:
        gc.enable()
    return TimingResult(max(ends), engine.tasks_done, time.perf_counter() - t0)


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
