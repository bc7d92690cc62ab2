"""NVLS (NVLink SHARP): the switch adds, so a GPU sends its buffer once and receives the sum once.

    from dplab.reference.nvls import nvls_time
    nvls_time("dgx-h100", 8, 1 << 28)          # one node: 2 alpha + (1 + 1/p) n beta
    nvls_time("dgx-h100x128", 1024, 1 << 28)    # NVLS in each node, a double tree between nodes

No schedule can say this: a schedule moves bytes between ranks, and here the switch is what adds.
Inside one NVSwitch domain (a node of g GPUs), NCCL's NVLS all-reduce is two moves (NCCL 2.17,
``multimem.ld_reduce`` and ``multimem.st``): GPU r asks the switch for chunk r summed over the g
GPUs (the switch reads chunk r from every GPU: each GPU's port sends n bytes in all, and receives
its n/g of the sum), then GPU r stores that chunk once to a multicast address and the switch writes
it into every GPU (each port sends n/g and receives n). On full-duplex ports that is
2 alpha + (1 + 1/g) n beta, against the ring's 2(g-1) alpha + 2(g-1)/g n beta: about half the bytes,
and two latencies instead of 2(g-1). The device adds nothing: no gamma.

Across N nodes (NCCL's NVLSTree, 2.18) the switch reduces inside each node; each of a node's g GPUs
then all-reduces its n/g across the nodes through its own NIC (a double binary tree, priced by the
cost model on the cluster's inter link), and the switch multicasts the result. Priced here as the
three moves one after another, an upper bound: NCCL pipelines them, so its time tends to the
slowest move's. The cluster says whether its switch adds (``links.intra.switch_reduces``).
"""

from __future__ import annotations

from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.cluster import Cluster, cluster
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError
from dplab.reference.topology import Topology

__all__ = ["nvls_time", "ACROSS"]

ACROSS = "double_tree"  # NVLSTree's schedule between nodes


def nvls_time(c: Cluster | str, world_size: int, nbytes: int, itemsize: int = 4) -> float:
    """Seconds of one NVLS all-reduce of ``nbytes`` on ``world_size`` ranks of cluster ``c``.

    Args:
        c: a cluster (or a preset's name) whose intra link's switch adds (``switch_reduces``).
        world_size: the ranks, ``ranks_per_node`` to a node; several nodes use NVLSTree.
        nbytes: the buffer, ``nbytes // itemsize`` elements.

    Returns:
        The simulated seconds (the moves one after another across nodes: an upper bound).

    Raises:
        ConfigError: the cluster's switch does not add, or the world does not fit the cluster.
    """
    c = cluster(c)
    c.check_world(world_size)
    if not c.intra.switch_reduces:
        raise ConfigError(f"cluster {c.name!r} has no switch that adds "
                          "(links.intra.switch_reduces): NVLS needs NVSwitch with NVLink SHARP, "
                          "e.g. dgx-h100; use ring or tree here")
    g = min(world_size, c.ranks_per_node)
    nodes = -(-world_size // c.ranks_per_node)
    n = nbytes // itemsize * itemsize
    intra = c.intra
    if nodes == 1:
        return 2 * intra.alpha + (1 + 1 / g) * n * intra.beta
    # reduce in the switch (send n, receive n/g), the nodes' all-reduce of n/g, multicast (n/g, n)
    between = Topology.flat(c.inter.alpha, c.inter.beta, c.gamma, f"{c.name} between nodes")
    piece = n // g // itemsize * itemsize
    schedule = allreduce_schedule(ACROSS, nodes)
    across = cost(schedule, piece, itemsize=itemsize, topology=between).time
    return 2 * (intra.alpha + n * intra.beta) + across
