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

from dataclasses import dataclass

from dplab.reference.errors import ConfigError

__all__ = ["Link", "Topology", "PRESETS"]


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha`` seconds per message, ``beta`` seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ConfigError(f"a link needs alpha >= 0 s and beta >= 0 s/byte, got {self.alpha}, "
                              f"{self.beta}")


@dataclass(frozen=True)
class Topology:
    """Nodes of ``ranks_per_node`` consecutive ranks; ``intra`` links inside a node, ``inter`` between.

    ``gamma`` is seconds per byte reduced. ``source`` says where the numbers come from."""

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
        """The one-level model: every rank its own node, every message on the same link."""
        link = Link(alpha, beta)
        return Topology(name, 1, link, link, gamma, "one alpha, beta, gamma for every message")

    @property
    def one_level(self) -> bool:
        return self.ranks_per_node == 1 or self.intra == self.inter


_H100_GAMMA = 3 / 3.35e12  # a reduce reads two bytes and writes one per byte; HBM3 3.35 TB/s
PRESETS: dict[str, Topology] = {
    "flat-10g": Topology("flat-10g", 1, Link(5e-6, 1 / 1.25e9), Link(5e-6, 1 / 1.25e9), 0.0,
                         "one level: 10 Gb/s Ethernet (1.25 GB/s each way), 5 us a message, free reduction"),
    "dgx-h100": Topology(
        "dgx-h100", 8, Link(2e-6, 1 / 450e9), Link(5e-6, 1 / 50e9), _H100_GAMMA,
        "NVIDIA DGX H100 datasheet: 8 H100 SXM per node, NVLink4 900 GB/s bidirectional per GPU "
        "(450 GB/s each way), 8 ConnectX-7 400 Gb/s NDR InfiniBand ports, one per GPU (50 GB/s each "
        "way); H100 SXM datasheet: HBM3 3.35 TB/s (gamma: 3 bytes moved per byte reduced). alpha: "
        "NCCL's src/graph/tuning.cc prices an NVLink ring hop at 0.5-3.4 us by protocol and a network "
        "hop at several us; we take 2 us inside a node and 5 us between nodes."),
    "h100-100g": Topology(
        "h100-100g", 8, Link(2e-6, 1 / 450e9), Link(10e-6, 1 / 12.5e9), _H100_GAMMA,
        "as dgx-h100, with one 100 Gb/s port per GPU between nodes (12.5 GB/s each way) and 10 us "
        "network latency: a commodity Ethernet cluster"),
}
