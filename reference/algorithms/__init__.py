"""The all-reduce algorithms, each a pure function ``world_size -> Schedule``.

``native`` is not here on purpose: it names the engine's own all-reduce
(MPI_Allreduce, dist.all_reduce), the yardstick our algorithms are measured against.
"""

from __future__ import annotations

from functools import lru_cache

from dplab.reference.algorithms import direct, naive, ring, tree
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule

__all__ = ["ALLREDUCE", "ALGORITHMS", "allreduce_schedule", "direct", "naive", "ring", "tree"]

ALLREDUCE = {"naive": naive.allreduce, "ring": ring.allreduce, "tree": tree.allreduce,
             "direct": direct.allreduce}
ALGORITHMS = (*ALLREDUCE, "native")


@lru_cache(maxsize=256)
def allreduce_schedule(algorithm: str, world_size: int) -> Schedule:
    """The all-reduce schedule of ``algorithm`` for ``world_size`` ranks (cached: schedules are immutable)."""
    if algorithm not in ALLREDUCE:
        raise ConfigError(
            f"no schedule for all-reduce algorithm {algorithm!r}: choose one of "
            f"{', '.join(ALLREDUCE)} ('native' is the engine's own, it has no schedule)"
        )
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    return ALLREDUCE[algorithm](world_size)
