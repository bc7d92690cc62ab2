"""Before a sim world starts: its cluster, checked, and the world its rank threads share.

A sim world is one forked process holding every rank as a thread (``dplab.backends.launch.ranks``,
start "threads", as the cuda backend), with the engine, the network and the devices made here,
before the fork. Its threads and clocks go on virtual time in that process only (``threads.py``).
"""

from __future__ import annotations

import os
from multiprocessing.context import BaseContext
from typing import Any

from dplab.backends.sim.engine import Actor, Engine, Resource, Task
from dplab.backends.sim.network import Network
from dplab.reference.cluster import Cluster, cluster
from dplab.reference.topology import Topology

__all__ = ["available", "prepare", "SimWorld", "CLUSTER_ENV", "DEFAULT_CLUSTER", "resolve_cluster"]

CLUSTER_ENV = (
    "DPLAB_CLUSTER"  # the cluster a sim world runs on when none is given (the CLI sets it)
)
DEFAULT_CLUSTER = "dgx-h100"


def available() -> str | None:
    """The simulator needs nothing beyond numpy: always there."""
    return None


def resolve_cluster(name: str | Cluster | None) -> Cluster:
    """``name`` (a preset, a family member, a file) or ``$DPLAB_CLUSTER`` or ``DEFAULT_CLUSTER``."""
    return cluster(name if name is not None else os.environ.get(CLUSTER_ENV) or DEFAULT_CLUSTER)


class SimWorld:
    """What the rank threads of one simulated world share: the cluster, the engine (clocks and
    queues), the network (links and ports) and one device resource per physical device."""

    def __init__(self, c: Cluster, world_size: int, timeout: float, ranks: bool = True) -> None:
        """``ranks``: add each rank's main actor (its thread); timing-only runs add step actors."""
        c.check_world(world_size)
        self.cluster, self.world_size, self.timeout = c, world_size, timeout
        self.engine = Engine()
        shared: dict[Any, Resource] = {}
        if c.device_pool:  # a node's devices serve its ranks as one pool (processes on cores)
            self.devices = [
                shared.setdefault(c.node_of(r), Resource(
                    f"node {c.node_of(r)}'s {c.devices_per_node} devices", c.devices_per_node))
                for r in range(world_size)
            ]
        else:
            self.devices = [
                shared.setdefault(c.device_of(r), Resource(f"device {c.device_of(r)}"))
                for r in range(world_size)
            ]
        self.device_of = [c.device_for(r) for r in range(world_size)]
        streams: dict[int, Resource] = {}  # each device's communication stream (see ``reduced``)
        self.streams = [streams.setdefault(id(d), Resource(f"{d.name} comm stream"))
                        for d in self.devices]
        self.gamma = [
            c.gamma * max(1.0, s.compute) if (s := c._slow.get(r)) else c.gamma
            for r in range(world_size)
        ]
        self.hosts, host_alpha = None, None
        if c.threads:  # a node's ranks are threads of one process: its host work takes turns
            per_node = [sum(1 for q in range(world_size) if c.node_of(q) == n)
                        for n in range(c.nodes)]
            hosts = [Resource(f"node {n} host") for n in range(c.nodes)]
            self.hosts = [hosts[c.node_of(r)] for r in range(world_size)]
            self.host_extra = [c.per_thread * per_node[c.node_of(r)] for r in range(world_size)]
            host_alpha = [c.link(r, r).alpha + self.host_extra[r] for r in range(world_size)]
        self.network = Network(self.engine, c, world_size, self.devices, self.hosts, host_alpha)
        self.engine.diagnose = lambda actor: self.network.diagnose(actor.rank)
        self.topology = Topology.of(c)  # what the cost model (and auto) price on this cluster
        copies = c.intra.on_device or (
            c.inter.on_device and c.nodes > 1
        )  # messages use devices too
        self.exclusive = [not copies and self.devices.count(d) == 1 and d.servers == 1
                          for d in self.devices]
        for r in range(world_size if ranks else 0):
            self.engine.add(Actor((r, 0), main=True, name=f"rank {r}"))

    def compute_seconds(self, rank: int, flops: float, nbytes: float, dtype: str,
                        ops: int = 1) -> float:
        """The roofline time of ``ops`` operations doing ``flops`` and moving ``nbytes`` on
        ``rank``'s device (at least the device's least time per operation)."""
        d = self.device_of[rank]
        return max(flops / d.rate(dtype), nbytes / d.memory_bytes_s, ops * d.op_overhead_s)

    def spend(self, actor: Actor, rank: int, ops: Any, dtype: str) -> float:
        """``actor`` (of ``rank``) computed ``ops`` [(flops, bytes)]: their time owed on its device;
        where ranks are threads of one process, each operation's launch owed on the host and its
        roofline queued on the device behind it. Returns the seconds owed."""
        ops = list(ops)
        if self.hosts is None:
            seconds = sum(self.compute_seconds(rank, f, n, dtype) for f, n in ops)
            self.engine.owe(actor, seconds, self.devices[rank])
            return seconds
        d = self.device_of[rank]
        host = len(ops) * (d.op_overhead_s + self.host_extra[rank])
        self.engine.owe(actor, host, self.hosts[rank])  # launched first, then run on the device
        self.behind(actor, rank, sum(max(f / d.rate(dtype), n / d.memory_bytes_s) for f, n in ops))
        return host

    def reduced(self, actor: Actor, rank: int, nbytes: int, algorithm: str = "") -> None:
        """``actor`` reduced ``nbytes`` in a round of ``algorithm``: gamma each, on its device
        (behind the host if threads); nothing where the algorithm's fitted beta includes it. A
        thread the rank started (a reducer's comm thread) reduces on the device's communication
        stream, beside the rank's compute rather than queued behind it, as NCCL's kernels run on a
        stream of their own while backward runs (the SMs and memory bandwidth they take from the
        compute are left out).

        Args:
            actor: the rank's thread (or step actor) that reduced.
            rank: its rank; nbytes: the bytes it added into its buffer.
            algorithm: the all-reduce the round belongs to ("" if none).
        """
        if self.cluster.folds_gamma(algorithm):
            return
        on = self.devices[rank] if actor.key[1] == 0 else self.streams[rank]
        if self.hosts is None:
            self.engine.owe(actor, nbytes * self.gamma[rank], on)
        else:
            self.behind(actor, rank, nbytes * self.gamma[rank], on)

    def behind(self, actor: Actor, rank: int, seconds: float, on: Resource | None = None) -> None:
        """Device work queued on rank's device (or ``on``) when the actor's host gets there; none
        waits."""
        if seconds > 0:
            at = self.engine.later(actor)
            self.engine.submit(Task([(on or self.devices[rank], seconds)], lambda end: None,
                                    (at, self.engine.order(0, rank))), at)


def prepare(
    ctx: BaseContext,
    session: str,
    world_size: int,
    timeout: float,
    cluster: str | Cluster | None = None,
) -> tuple[Any, Any]:
    """(connect(rank), nothing to keep): the world is made here, before the ranks' process forks."""
    from dplab.backends.sim.comm import SimComm
    from dplab.backends.sim.threads import install

    world = SimWorld(resolve_cluster(cluster), world_size, timeout)

    comms: list[SimComm | None] = [None] * world_size

    def contact(actor: Actor) -> None:  # a rank's main thread touched the simulation
        comm = comms[actor.rank]
        if actor.main and comm is not None and comm._clock is None:
            comm._start_clock()

    def connect(rank: int) -> SimComm:
        install(world.engine)  # in the forked process only: the launcher's threads stay real
        world.engine.contact = contact
        comms[rank] = SimComm(world, rank)
        return comms[rank]

    return connect, None
