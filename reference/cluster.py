"""A cluster as data: nodes of devices joined by links. The one description that the simulator
(``--backend sim``), the cost model (``Topology.of``) and ``auto`` read.

    from dplab.reference.cluster import cluster, load_cluster, CLUSTERS
    c = cluster("dgx-h100x2")          # a preset (CLUSTERS), or <preset>x<nodes>: 2 DGX H100 nodes
    c = cluster("my-cluster.toml")     # your own file, checked on load (a ConfigError naming it)
    c.node_of(9), c.device_of(9)       # where rank 9 runs: node 1, device (1, 1)
    c.link(3, 9)                       # the Link a message from rank 3 to rank 9 crosses: "inter"

A file is JSON (or TOML on Python >= 3.11); every number carries its unit in its key:

    name = "two-workstations"
    nodes = 2
    ranks_per_node = 4                 # rank r runs on node r // 4; at most nodes x 4 ranks
    devices_per_node = 4               # a node's ranks share its devices round robin
    reduce_gb_s = 300                  # optional: bytes reduced a second (default memory_gb_s / 3;
                                       # null in JSON: free, as the alpha-beta model)
    sources = ["where every number comes from"]
    [device]                           # every rank's device, unless a straggler changes it
    name = "RTX 4090"
    tflop_s = {float32 = 82.6, bfloat16 = 165.2}     # or one number for every dtype
    memory_gb = 24
    memory_gb_s = 1008
    op_overhead_us = 5                 # optional: the least an operation (a kernel) takes
    [links.intra]                      # between ranks of one node
    alpha_us = 10                      # per message
    bandwidth_gb_s = 25                # each way, per port
    ranks_per_port = 1                 # optional: 4 = one port shared by 4 ranks (one NIC per node)
    on_device = false                  # optional: true = a message is the receiver's device's copy
    cache_mib = 32                     # optional, with past_cache_gb_s: a collective whose buffers
    past_cache_gb_s = 5                # on a node fill the cache moves its bytes at this rate
    crowded_alpha_us = {ring = 130}    # optional: an algorithm's alpha while a node's ranks
                                       # outnumber its devices (they sleep and take turns)
    switch_reduces = false             # optional: the switch adds (NVLS, reference/nvls.py)
    [links.intra.algorithms]           # optional: an algorithm whose messages cost otherwise, as
    native = {alpha_us = 4, bandwidth_gb_s = 30}   # dplab tune fits it alone (gamma folded in)
    [links.inter]                      # between nodes (required when nodes > 1)
    alpha_us = 30
    bandwidth_gb_s = 3.125
    device_pool = false                # optional: true = a node's ranks take whichever of its
                                       # devices is free (processes on cores), not one round robin
    [host]                             # optional: the ranks of a node are threads of one process
    threads = true                     # (the cuda backend): alpha and launches take turns there,
    per_thread_us = 12                 # each costing this much more per rank thread it holds
    [[stragglers]]                     # optional: a slower device or link is part of the cluster
    rank = 3
    compute = 4.0                      # rank 3 computes 4 times slower
    link = 2.0                         # and its ports move bytes 2 times slower

How the simulator prices time on a cluster: ``dplab.backends.sim``. GB is 10^9 bytes, as vendors
write it; TFLOP/s is 10^12 operations per second.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["Device", "Link", "Straggler", "Cluster", "cluster", "load_cluster", "cluster_from_dict",
           "CLUSTERS", "PRESET_DIR"]

PRESET_DIR = Path(__file__).with_name("clusters")  # shipped presets: one JSON file each
_FAMILY = re.compile(r"^(?P<base>.+)x(?P<nodes>[0-9]+)$")  # "dgx-h100x8": 8 nodes of dgx-h100
MAX_NODES = 128  # a preset family's largest member: 1,024 GPUs of 8 per node


@dataclass(frozen=True)
class Device:
    """What a rank computes on. ``flop_s``: operations per second by dtype name ("float32", ...;
    "default" for any other); ``memory_bytes``; ``memory_bytes_s``: bytes per second to and from
    its memory; ``op_overhead_s``: the least any operation takes (a kernel launch, an interpreter's
    call); ``ranks``: how many ranks share it (set by the cluster)."""

    name: str
    flop_s: tuple[tuple[str, float], ...]
    memory_bytes: float
    memory_bytes_s: float
    op_overhead_s: float = 0.0

    def rate(self, dtype: str) -> float:
        """Operations per second in ``dtype`` (its own rate, else the "default" one)."""
        rates = dict(self.flop_s)
        return rates.get(dtype, rates.get("default", max(rates.values())))

    def slowed(self, factor: float) -> Device:
        """This device computing ``factor`` times slower (a straggler); its memory is unchanged."""
        if factor == 1:
            return self
        return replace(
            self,
            name=f"{self.name} at 1/{factor:g} speed",
            flop_s=tuple((k, v / factor) for k, v in self.flop_s),
            memory_bytes_s=self.memory_bytes_s / factor,
            op_overhead_s=self.op_overhead_s * factor,
        )


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha`` seconds per message, ``beta`` seconds per byte (1 / bandwidth).

    ``ranks_per_port``: ranks that share one port (1: a port per rank, a NIC per GPU; a node's
    ranks: one NIC per node). ``on_device``: a message is a copy made by the receiving rank's
    device (shared memory on one machine, several ranks on one GPU), so it queues with that
    device's compute instead of on a port. ``algorithms``: (name, alpha, beta) of algorithms whose
    messages this link carries at other terms (a transport that runs them otherwise: the local
    backend's one-shot ``native``), as ``dplab tune`` fits each alone, a reduction's gamma folded
    into beta. The cost model reads only alpha and beta. ``switch_reduces``: the link's switch can
    add what the ranks send it (NVLink SHARP on an NVSwitch): NVLS is priced on it
    (``dplab.reference.nvls``); schedules ignore it. ``cache_bytes``, ``past_cache_beta``: a copy
    on shared memory runs from the last-level cache while the buffers it works on fit there, and
    from memory once they do not: a message of a collective whose buffers on the node (every
    rank's) fill ``cache_bytes`` or more costs ``past_cache_beta`` per byte instead of its beta (0:
    no cache, beta at every size; buffers that fill it cannot all stay, beside the code and the
    transport's own data). ``crowded``: (name, alpha) of algorithms whose messages cost another
    alpha while the ranks of a world on the receiver's node outnumber its devices (processes on
    fewer cores: a waiting rank sleeps rather than spins, and the operating system must wake it
    and give it a core). The cost model reads none of these."""

    alpha: float
    beta: float
    ranks_per_port: int = 1
    on_device: bool = False
    name: str = ""
    algorithms: tuple[tuple[str, float, float], ...] = ()
    switch_reduces: bool = False
    cache_bytes: float = 0.0
    past_cache_beta: float = 0.0
    crowded: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ConfigError(
                f"a link needs alpha >= 0 s and beta >= 0 s/byte, got {self.alpha}, {self.beta}"
            )
        if type(self.ranks_per_port) is not int or self.ranks_per_port < 1:
            raise ConfigError(
                f"a link's ranks_per_port must be an integer >= 1, got {self.ranks_per_port!r}"
            )

    def slowed(self, factor: float) -> Link:
        """This link ``factor`` times slower (a straggler's), its algorithms' terms alike."""
        if factor == 1:
            return self
        return replace(self, alpha=self.alpha * factor, beta=self.beta * factor,
                       algorithms=tuple((k, a * factor, b * factor)
                                        for k, a, b in self.algorithms),
                       past_cache_beta=self.past_cache_beta * factor,
                       crowded=tuple((k, a * factor) for k, a in self.crowded))

    def beta_at(self, footprint: float) -> float:
        """Seconds per byte of a message whose collective works on ``footprint`` bytes on the
        receiver's node: ``past_cache_beta`` once they fill the cache, else beta.

        Args:
            footprint: the bytes of every rank's buffer on the node (0: unknown, in cache).

        Returns:
            The link's seconds per byte at that footprint.
        """
        if self.cache_bytes and footprint >= self.cache_bytes:
            return self.past_cache_beta
        return self.beta

    def for_algorithm(self, algorithm: str, crowded: bool = False) -> Link:
        """This link as ``algorithm``'s messages see it: its own fitted terms where it has some.

        Args:
            algorithm: an all-reduce's name ("ring", "native", ...), or "" for other messages.
            crowded: the ranks on the receiver's node outnumber its devices: the algorithm's
                ``crowded`` alpha, where the link has one.

        Returns:
            A ``Link`` with that algorithm's alpha and beta (and no algorithms of its own), or
            this link unchanged.
        """
        link = self
        for name, alpha, beta in self.algorithms:
            if name == algorithm:
                link = replace(self, alpha=alpha, beta=beta, algorithms=())
        for name, alpha in self.crowded if crowded else ():
            if name == algorithm:
                link = replace(link, alpha=alpha)
        return link

    def folds_gamma(self, algorithm: str) -> bool:
        """Whether ``algorithm`` has fitted terms here, whose beta includes its reductions."""
        return any(name == algorithm for name, _, _ in self.algorithms)


@dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` computes ``compute`` times slower and its ports move bytes ``link`` times
    slower."""

    rank: int
    compute: float = 1.0
    link: float = 1.0


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` rank slots; rank r runs on node r // ranks_per_node and
    on device (r % ranks_per_node) % devices_per_node of it. ``intra`` links join ranks of one node,
    ``inter`` links join nodes; ``gamma`` is seconds per byte reduced. ``sources`` says where every
    number comes from.

    ``threads``: a node's ranks are threads of one process (the cuda backend): their host work, a
    message's alpha and an operation's launch, takes turns in that one interpreter, each costing
    ``per_thread`` seconds more for every rank thread there (they contend for its lock), while the
    device's work (a message's bytes, a reduction, an operation's FLOPs) runs behind, on its
    stream.

    ``device_pool``: a node's ranks share its devices as one pool, each task on whichever device
    is free (an operating system's processes on its cores), instead of rank r on device
    r % devices_per_node: p ranks that all work take p / devices times as long (they queue, as
    messages on a port do: the last is done when a fair share would finish them all), and those
    that work while others wait run at full speed. Memory is then the node's, for all its ranks."""

    name: str
    nodes: int
    ranks_per_node: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    gamma: float
    sources: tuple[str, ...] = ()
    stragglers: tuple[Straggler, ...] = ()
    note: str = ""
    threads: bool = False
    per_thread: float = 0.0
    device_pool: bool = False
    _slow: dict[int, Straggler] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in ("nodes", "ranks_per_node", "devices_per_node"):
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise ConfigError(
                    f"cluster {self.name!r}: {key} must be an integer >= 1, got {value!r}"
                )
        if self.devices_per_node > self.ranks_per_node:
            raise ConfigError(
                f"cluster {self.name!r}: devices_per_node {self.devices_per_node} > "
                f"ranks_per_node {self.ranks_per_node}: every device needs a rank slot"
            )
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ConfigError(f"cluster {self.name!r}: gamma must be >= 0 s/byte, got {self.gamma}")
        for s in self.stragglers:
            if s.rank in self._slow:
                raise ConfigError(f"cluster {self.name!r}: straggler rank {s.rank} is named twice")
            self._slow[s.rank] = s

    @property
    def size(self) -> int:
        """The most ranks this cluster holds."""
        return self.nodes * self.ranks_per_node

    @property
    def source(self) -> str:
        return "; ".join(self.sources)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def device_of(self, rank: int) -> tuple[int, int]:
        """(node, device index on it): ranks with the same pair share one device."""
        return self.node_of(rank), (rank % self.ranks_per_node) % self.devices_per_node

    def device_for(self, rank: int) -> Device:
        """Rank ``rank``'s device, slowed if the cluster names it a straggler."""
        slow = self._slow.get(rank)
        return self.device if slow is None else self.device.slowed(slow.compute)

    def link(self, src: int, dst: int) -> Link:
        """The link a message from ``src`` to ``dst`` crosses, slowed by either end's straggler."""
        link = self.intra if self.node_of(src) == self.node_of(dst) else self.inter
        factor = max(self._slow[r].link if r in self._slow else 1.0 for r in (src, dst))
        return link.slowed(factor)

    def ranks_sharing_device(self, world_size: int) -> int:
        """The most ranks of a world of ``world_size`` that share one device's memory (a pool's:
        every rank of the node)."""
        counts: dict[Any, int] = {}
        for r in range(world_size):
            key = self.node_of(r) if self.device_pool else self.device_of(r)
            counts[key] = counts.get(key, 0) + 1
        return max(counts.values(), default=1)

    def folds_gamma(self, algorithm: str) -> bool:
        """Whether ``algorithm``'s messages carry fitted terms (on either link) whose beta already
        includes its reductions, so no gamma is charged on top.

        Args:
            algorithm: an all-reduce's name, or "" for other messages.

        Returns:
            True where a link has terms of its own for ``algorithm``.
        """
        return self.intra.folds_gamma(algorithm) or self.inter.folds_gamma(algorithm)

    def check_world(self, world_size: int) -> None:
        """ConfigError unless ``world_size`` ranks fit (and every named straggler is one of
        them)."""
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if world_size > self.size:
            raise ConfigError(
                f"cluster {self.name!r} holds {self.size} ranks ({self.nodes} node"
                f"{'s' if self.nodes > 1 else ''} x {self.ranks_per_node}), not {world_size}: "
                f"use --world-size {self.size} or less, or a larger cluster"
            )
        for s in self.stragglers:
            if s.rank >= world_size:
                raise ConfigError(
                    f"cluster {self.name!r} names rank {s.rank} a straggler, but the world "
                    f"has ranks 0..{world_size - 1}"
                )

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, name=f"{self.name}x{nodes}", nodes=nodes)

    def with_stragglers(self, stragglers: tuple[Straggler, ...]) -> Cluster:
        return replace(self, stragglers=(*self.stragglers, *stragglers))

    def describe(self) -> str:
        """One line: what the cluster is."""
        d = self.device
        rates = ", ".join(f"{k} {v / 1e12:g}" for k, v in d.flop_s)
        link = lambda k: f"{k.name or 'a link'} {1 / k.beta / 1e9:g} GB/s each way"  # noqa: E731
        two = f", {link(self.inter)} between nodes" if self.nodes > 1 else ""
        return (
            f"{self.name}: {self.nodes} x {self.ranks_per_node} ranks on {d.name} ({rates} "
            "TFLOP/s; "
            f"{d.memory_bytes / 1e9:g} GB at {d.memory_bytes_s / 1e9:g} GB/s), "
            f"{link(self.intra)} inside a node{two}"
        )


# -- files -----------------------------------------------------------------------------------------
_TOP = {
    "name",
    "nodes",
    "ranks_per_node",
    "devices_per_node",
    "device",
    "links",
    "reduce_gb_s",
    "stragglers",
    "sources",
    "note",
    "host",
    "device_pool",
}
_HOST = {"threads", "per_thread_us"}
_DEVICE = {"name", "tflop_s", "memory_gb", "memory_gb_s", "op_overhead_us"}
_LINK = {"name", "alpha_us", "bandwidth_gb_s", "ranks_per_port", "on_device", "algorithms",
         "switch_reduces", "cache_mib", "past_cache_gb_s", "crowded_alpha_us"}
_TERMS = {"alpha_us", "bandwidth_gb_s"}
_STRAGGLER = {"rank", "compute", "link"}


def _number(where: str, value: Any, *, positive: bool = True) -> float:
    """``value`` as a finite float > 0 (or >= 0), else a ConfigError naming ``where``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        want = "a number > 0" if positive else "a number >= 0"
        shown = "missing" if value is None else repr(value)
        raise ConfigError(f"{where} is {shown}: it must be {want}")
    return float(value)


def _table(where: str, value: Any, keys: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table (an object) with {', '.join(required)}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ConfigError(
            f"{where} has an unknown key {unknown[0]!r}: the keys are {', '.join(sorted(keys))}"
        )
    for key in required:
        if key not in value:
            raise ConfigError(f"{where}.{key} is missing: it must be given")
    return value


def _device(where: str, d: Any) -> Device:
    d = _table(where, d, _DEVICE, ("tflop_s", "memory_gb", "memory_gb_s"))
    rates = d["tflop_s"] if isinstance(d["tflop_s"], dict) else {"default": d["tflop_s"]}
    if not rates:
        raise ConfigError(f"{where}.tflop_s is empty: give one rate, or one per dtype")
    flop_s = tuple(
        (str(k), _number(f"{where}.tflop_s.{k}", v) * 1e12) for k, v in sorted(rates.items())
    )
    return Device(
        str(d.get("name", "device")),
        flop_s,
        _number(f"{where}.memory_gb", d["memory_gb"]) * 1e9,
        _number(f"{where}.memory_gb_s", d["memory_gb_s"]) * 1e9,
        _number(f"{where}.op_overhead_us", d.get("op_overhead_us", 0), positive=False) / 1e6,
    )


def _link(where: str, k: Any) -> Link:
    k = _table(where, k, _LINK, ("alpha_us",))  # a missing bandwidth: _number says what it must be
    ports = k.get("ranks_per_port", 1)
    if type(ports) is not int or ports < 1:
        raise ConfigError(f"{where}.ranks_per_port is {ports!r}: it must be an integer >= 1")
    on_device = k.get("on_device", False)
    if not isinstance(on_device, bool):
        raise ConfigError(f"{where}.on_device is {on_device!r}: it must be true or false")
    bandwidth = _number(f"{where}.bandwidth_gb_s", k.get("bandwidth_gb_s"))
    given = k.get("algorithms", {})
    names = set(given) if isinstance(given, dict) else set()
    algorithms = _table(f"{where}.algorithms", given, names, ())
    terms = []
    for name, t in sorted(algorithms.items()):
        t = _table(f"{where}.algorithms.{name}", t, _TERMS, ("alpha_us",))
        terms.append((str(name),
                      _number(f"{where}.algorithms.{name}.alpha_us", t["alpha_us"],
                              positive=False) / 1e6,
                      1 / (_number(f"{where}.algorithms.{name}.bandwidth_gb_s",
                                   t.get("bandwidth_gb_s")) * 1e9)))
    reduces = k.get("switch_reduces", False)
    if not isinstance(reduces, bool):
        raise ConfigError(f"{where}.switch_reduces is {reduces!r}: it must be true or false")
    cache = past = 0.0
    if "cache_mib" in k or "past_cache_gb_s" in k:  # one without the other: the missing one named
        cache = _number(f"{where}.cache_mib", k.get("cache_mib")) * (1 << 20)
        past = 1 / (_number(f"{where}.past_cache_gb_s", k.get("past_cache_gb_s")) * 1e9)
    given = k.get("crowded_alpha_us", {})
    names = set(given) if isinstance(given, dict) else set()
    crowded = tuple((str(name), _number(f"{where}.crowded_alpha_us.{name}", alpha,
                                        positive=False) / 1e6)
                    for name, alpha in sorted(_table(f"{where}.crowded_alpha_us", given, names,
                                                     ()).items()))
    return Link(
        _number(f"{where}.alpha_us", k["alpha_us"], positive=False) / 1e6,
        1 / (bandwidth * 1e9),
        ports,
        on_device,
        str(k.get("name", "")),
        tuple(terms),
        reduces,
        cache,
        past,
        crowded,
    )


def cluster_from_dict(data: Any, source: str = "the cluster") -> Cluster:
    """The cluster ``data`` (a parsed file) describes, every field checked.

    Args:
        data: the parsed JSON or TOML (the module docstring shows its keys).
        source: where it came from, for the error.

    Returns:
        The ``Cluster``.

    Raises:
        ConfigError: in one line, naming the first bad or missing field and what it must be.
    """
    d = _table(source, data, _TOP, ("name", "nodes", "ranks_per_node", "device", "links"))
    for key in ("nodes", "ranks_per_node", "devices_per_node"):
        v = d.get(key, d["ranks_per_node"] if key == "devices_per_node" else None)
        if type(v) is not int or v < 1:
            raise ConfigError(f"{source}: {key} is {v!r}: it must be an integer >= 1")
    device = _device(f"{source}: device", d["device"])
    links = _table(f"{source}: links", d["links"], {"intra", "inter"}, ("intra",))
    intra = _link(f"{source}: links.intra", links["intra"])
    if "inter" not in links and d["nodes"] > 1:
        raise ConfigError(
            f"{source}: links.inter is missing: a cluster of {d['nodes']} nodes needs the link "
            "between them"
        )
    inter = _link(f"{source}: links.inter", links["inter"]) if "inter" in links else intra
    reduce_s = device.memory_bytes_s / 3  # a reduction reads two bytes and writes one per byte
    if "reduce_gb_s" in d:
        given = d["reduce_gb_s"]
        reduce_s = math.inf if given is None else _number(f"{source}: reduce_gb_s", given) * 1e9
    stragglers = []
    for i, s in enumerate(d.get("stragglers", [])):
        s = _table(f"{source}: stragglers[{i}]", s, _STRAGGLER, ("rank",))
        if type(s["rank"]) is not int or s["rank"] < 0:
            raise ConfigError(
                f"{source}: stragglers[{i}].rank is {s['rank']!r}: it must be a rank >= 0"
            )
        factors = [
            _number(f"{source}: stragglers[{i}].{k}", s.get(k, 1.0)) for k in ("compute", "link")
        ]
        if min(factors) < 1:
            raise ConfigError(
                f"{source}: stragglers[{i}]: compute and link are slowdowns >= 1 (2 = twice "
                f"as slow), got {factors[0]:g} and {factors[1]:g}"
            )
        stragglers.append(Straggler(s["rank"], *factors))
    sources = d.get("sources", [])
    if not (isinstance(sources, list) and all(isinstance(s, str) for s in sources)):
        raise ConfigError(
            f"{source}: sources must be a list of strings (where each number comes from)"
        )
    host = _table(f"{source}: host", d.get("host", {}), _HOST, ())
    if not isinstance(host.get("threads", False), bool):
        raise ConfigError(f"{source}: host.threads is {host['threads']!r}: "
                          "it must be true or false")
    per_thread = _number(f"{source}: host.per_thread_us", host.get("per_thread_us", 0),
                         positive=False)
    if not isinstance(d.get("device_pool", False), bool):
        raise ConfigError(f"{source}: device_pool is {d['device_pool']!r}: "
                          "it must be true or false")
    return Cluster(
        str(d["name"]),
        d["nodes"],
        d["ranks_per_node"],
        d.get("devices_per_node", d["ranks_per_node"]),
        device,
        intra,
        inter,
        1 / reduce_s,
        tuple(sources),
        tuple(stragglers),
        str(d.get("note", "")),
        host.get("threads", False),
        per_thread / 1e6,
        d.get("device_pool", False),
    )


def load_cluster(path: str | Path) -> Cluster:
    """The cluster in the JSON or TOML file ``path``, checked; a ConfigError in one line
    otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"no cluster file at {p}: give a preset ({', '.join(CLUSTERS)}) or a JSON/TOML file"
        )
    try:
        text = p.read_text()
        if p.suffix == ".toml":
            if sys.version_info < (3, 11):
                raise ConfigError(
                    f"{p}: TOML needs Python >= 3.11 (tomllib): write the cluster as JSON"
                )
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # bad JSON or TOML, not UTF-8, unreadable
        raise ConfigError(f"cannot read the cluster file {p}: {e}") from None
    return cluster_from_dict(data, str(p))


@cache
def _preset(name: str) -> Cluster:
    """The shipped preset ``name``, read and checked on first use (one bad file spoils itself)."""
    path = PRESET_DIR / f"{name}.json"
    return cluster_from_dict(json.loads(path.read_text()), f"preset {name}")


def cluster(name: str | Cluster) -> Cluster:
    """A preset by name (``CLUSTERS``), a family member "<preset>x<nodes>" (that many of the
    preset's nodes, 1..128), or a file path; a Cluster is returned as it is."""
    if isinstance(name, Cluster):
        return name
    if name in CLUSTERS:
        return _preset(name)
    family = _FAMILY.match(name)
    if family and family["base"] in CLUSTERS:
        nodes = int(family["nodes"])
        if not 1 <= nodes <= MAX_NODES:
            raise ConfigError(f"cluster {name!r}: {family['base']}x<nodes> takes "
                              f"1 to {MAX_NODES} nodes")
        return _preset(family["base"]).with_nodes(nodes)
    if name.endswith((".json", ".toml")) or "/" in name:
        return load_cluster(name)
    raise ConfigError(f"unknown cluster {name!r}: choose one of {', '.join(CLUSTERS)} (or "
                      "<preset>x<nodes>, e.g. dgx-h100x8), or give a JSON/TOML file")


CLUSTERS = tuple(sorted(f.stem for f in PRESET_DIR.glob("*.json")))  # the shipped presets' names
