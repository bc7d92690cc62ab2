"""``--cluster``: the simulated cluster of a ``--backend sim`` train, compare, bench or scaling.

    dplab train --backend sim --cluster dgx-h100x2 --world-size 16
    dplab bench --backends sim --cluster my-cluster.toml --world-sizes 8,64 --sizes 1M,1G

Checked before any rank starts (``RunSpec.validate``, ``BenchSpec.check``): an unknown name or a bad
file, a world larger than the cluster, a model that does not fit its devices, each in one line.
"""

from __future__ import annotations

from typing import Any

from dplab.reference.cluster import CLUSTERS

__all__ = ["add_cluster_arg"]


def add_cluster_arg(g: Any) -> None:
    """Add ``--cluster`` to a parser or argument group."""
    g.add_argument(
        "--cluster",
        metavar="NAME",
        default=None,
        help=f"--backend sim: the simulated cluster, a preset ({', '.join(CLUSTERS)}; "
        "<preset>x<N>: N of its nodes) or a JSON/TOML file (default: dgx-h100, or "
        "$DPLAB_CLUSTER)",
    )
