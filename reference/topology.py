"""Where the ranks sit: nodes of consecutive ranks, one kind of link inside a node, another between.

The flat alpha-beta-gamma model prices every message alike. A cluster does not: eight GPUs
in a node talk over NVLink (hundreds of GB/s), nodes over InfiniBand (tens of GB/s per GPU).
A ``Topology`` says how many consecutive ranks share a node (rank r is on node
r // ranks_per_node, the layout ``mpiexec`` and ``torchrun`` give by default) and what a message
costs on each kind of link; the cost model (``dplab.reference.costmodel``) prices every transfer
of a schedule on the link it crosses.

    from dplab.reference.topology import PRESETS, Topology
    Topology.flat(5e-6, 1 / 10e9, 0.0)          # the one-level model: every link the same
    PRESETS["dgx-h100"]                          # 8 H100 per node on NVLink4, 400 Gb/s NDR between

Ports. A rank has one port per kind of link, each full duplex (a GPU's NVLink ports and its
own NIC, as in a DGX H100, whose 8 GPUs each have a ConnectX-7). In a round a rank pays, on each
port, alpha per message and beta per byte for the larger of what it sends and what it receives
there; the two ports work at the same time, so the rank's round takes the slower port, plus
gamma for every byte it reduces. A round lasts as long as its slowest rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from dplab.reference.cluster import CLUSTERS, Cluster, Link, cluster
from dplab.reference.errors import ConfigError

__all__ = ["Link", "Topology", "PRESETS"]


@dataclass(frozen=True)
class Topology:
    """Nodes of ``ranks_per_node`` consecutive ranks; ``intra`` links inside a node, ``inter``
    between.

    ``gamma`` is seconds per byte reduced. ``source`` says where the numbers come from.

    Args:
        name: the machine's name.
        ranks_per_node: ranks per node.
        intra: the link inside a node.
        inter: the link between nodes.
        gamma: seconds per byte reduced.
        source: where the numbers come from.
    """

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    gamma: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not self.gamma >= 0:
            raise ConfigError(f"gamma must be >= 0 s/byte, got {self.gamma}")

    @staticmethod
    def flat(alpha: float, beta: float, gamma: float, name: str = "flat") -> Topology:
        """The one-level model: every rank its own node, every message on the same link.

        Args:
            alpha: seconds per message.
            beta: seconds per byte.
            gamma: seconds per byte reduced.
            name: the topology's name.

        Returns:
            A topology of one level.
        """
        link = Link(alpha, beta)
        return Topology(name, 1, link, link, gamma, "one alpha, beta, gamma for every message")

    @staticmethod
    def of(c: Cluster | str) -> Topology:
        """What the cost model prices on cluster ``c`` (or a preset's name): its nodes and its two
        links' alpha and beta, its gamma. Contention-free: a port per rank and no queueing on a
        shared port or device (the simulator, ``--backend sim``, has those).

        Args:
            c: a cluster, or a preset's name.

        Returns:
            The topology.

        Raises:
            ConfigError: an unknown preset.
        """
        c = cluster(c)
        return Topology(c.name, c.ranks_per_node, c.intra, c.inter, c.gamma, c.source)

    @property
    def one_level(self) -> bool:
        return self.ranks_per_node == 1 or (self.intra.alpha, self.intra.beta) == (self.inter.alpha,
                                                                                  self.inter.beta)


class _Presets(Mapping[str, Topology]):
    """The presets' topologies by name, each read from its cluster file when first asked for: a
    program that imports this module (``dplab train`` on the local backend) reads none of them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = tuple(dict.fromkeys(names))
        self._read: dict[str, Topology] = {}

    def __getitem__(self, name: str) -> Topology:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._read:
            self._read[name] = Topology.of(name)
        return self._read[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# Every cluster file's topology (reference/clusters/: one description for the simulator, the cost
# model and auto), the one-level textbook model and two GPU clusters first
PRESETS: Mapping[str, Topology] = _Presets(("flat-10g", "dgx-h100", "h100-100g", *CLUSTERS))
