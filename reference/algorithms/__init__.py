"""The collective algorithms, each a pure function ``world_size -> Schedule``: one registry.

    ALLREDUCE["ring"](4)                   # the ring all-reduce schedule for 4 ranks
    allreduce_schedule("ring", 4)          # the same, checked and cached
    SCATTER["ring"]                        # (reduce_scatter, allgather) schedule functions
    ROOTED["tree"]                         # (reduce, broadcast): (p, root) -> Schedule functions

An algorithm that takes an integer parameter (a pipeline's chunk count, a node's size) is
named ``"<name>:<int>"``, e.g. ``"pipelined_tree:8"``; its function is ``(world_size, param)``
and ``PARAMETRIC`` gives the default used when the name comes without one, ``PARAMETER_MAX``
the largest it takes (a schedule of a million pieces would take minutes to build and mean
nothing). ``split_name``
parses such a name; every table lookup goes through ``lookup``.

``native`` is not here on purpose: it names the engine's own all-reduce (MPI_Allreduce,
dist.all_reduce), the yardstick our algorithms are measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from dplab.reference.algorithms import (
    direct,
    double_tree,
    hierarchical,
    naive,
    pipelined,
    rabenseifner,
    recursive_doubling,
    ring,
    tree,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule

__all__ = ["ALLREDUCE", "SCATTER", "ROOTED", "PARAMETRIC", "PARAMETER_MAX", "ALGORITHMS",
           "SCATTER_ALGORITHMS", "allreduce_schedule", "split_name", "lookup", "has_schedule",
           "direct", "naive", "ring", "tree", "recursive_doubling", "rabenseifner", "double_tree",
           "pipelined", "hierarchical"]

ALLREDUCE: dict[str, Callable[..., Schedule]] = {
    "naive": naive.allreduce,
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "direct": direct.allreduce,
    "recursive_doubling": recursive_doubling.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "double_tree": double_tree.allreduce,
    "pipelined_tree": pipelined.pipelined_tree,
    "pipelined_ring": pipelined.pipelined_ring,
    "hierarchical": hierarchical.allreduce,
}
SCATTER: dict[str, tuple[Callable[..., Schedule], Callable[..., Schedule]]] = {
    "ring": (ring.reduce_scatter, ring.allgather),
    "direct": (direct.reduce_scatter, direct.allgather),
    "rabenseifner": (rabenseifner.reduce_scatter, rabenseifner.allgather),
}
ROOTED: dict[str, tuple[Callable[..., Schedule], Callable[..., Schedule]]] = {
    "tree": (tree.reduce, tree.broadcast), "naive": (naive.reduce, naive.broadcast),
}
PARAMETRIC: dict[str, int] = {
    "double_tree": pipelined.TREE_PIECES, "pipelined_tree": pipelined.TREE_PIECES,
    "pipelined_ring": pipelined.RING_SLICES,
    "hierarchical": hierarchical.NODE_SIZE,
}  # name -> the default of its integer parameter
PARAMETER_MAX: dict[str, tuple[int, str]] = {
    "double_tree": (pipelined.MAX_PIECES, "pieces per tree"),
    "pipelined_tree": (pipelined.MAX_PIECES, "pieces"),
    "pipelined_ring": (pipelined.MAX_PIECES, "slices"),
    "hierarchical": (hierarchical.MAX_NODE_SIZE, "ranks per node"),
}  # name -> (the largest parameter it takes, what it counts); the builders check the same bound
ALGORITHMS = (*ALLREDUCE, "native")  # what an all-reduce may be asked to run
SCATTER_ALGORITHMS = tuple(SCATTER)  # what reduce-scatter, all-gather (and so ZeRO, FSDP) may run


def split_name(algorithm: str) -> tuple[str, int | None]:
    """``"pipelined_tree:8"`` -> ``("pipelined_tree", 8)``; ``"ring"`` -> ``("ring", None)``.

    Args:
        algorithm: an algorithm's name, with or without ":<int>".

    Returns:
        (name, parameter), the parameter None when the name has none.

    Raises:
        ConfigError: a parameter on an algorithm that takes none, one that is not an integer, or one
            outside 1..``PARAMETER_MAX``.
    """
    name, sep, param = algorithm.partition(":")
    if not sep:
        return name, None
    if name not in PARAMETRIC:
        raise ConfigError(f"algorithm {name!r} takes no ':<int>' parameter: write {name!r}"
                          if name in ALLREDUCE else f"unknown algorithm {algorithm!r}")
    try:
        value = int(param)
    except ValueError:
        raise ConfigError(f"algorithm {algorithm!r}: the part after ':' must be an integer, "
                          f"e.g. '{name}:{PARAMETRIC[name]}'") from None
    top, what = PARAMETER_MAX[name]
    if not 1 <= value <= top:
        raise ConfigError(f"algorithm {algorithm!r}: the parameter ({what}) must be >= 1 and at "
                          f"most {top}, e.g. '{name}:{PARAMETRIC[name]}'")
    return name, value


def lookup(table: dict[str, Any], algorithm: str, what: str) -> tuple[Any, tuple[int, ...]]:
    """The table's entry for ``algorithm`` and the extra arguments its functions take.

    Args:
        table: one of ``ALLREDUCE``, ``SCATTER``, ``ROOTED``.
        algorithm: an algorithm's name, with or without ":<int>".
        what: the kind of schedule, for the message.

    Returns:
        (entry, extra): the table's entry, and ``(param,)`` for a parametric algorithm (its default
        when the name has none), else ``()``.

    Raises:
        ConfigError: the table has no such algorithm, or its parameter is bad (``split_name``).
    """
    name, param = split_name(algorithm)
    if name not in table:
        raise ConfigError(f"no {what} schedule for algorithm {algorithm!r}: choose one of "
                          f"{', '.join(table)}")
    if name in PARAMETRIC:
        return table[name], (PARAMETRIC[name] if param is None else param,)
    return table[name], ()


def has_schedule(algorithm: str, kind: str = "allreduce") -> bool:
    """Can ``algorithm`` run collective ``kind``: "allreduce" (``native`` included) or "scatter"
    (reduce-scatter and all-gather, which ZeRO and FSDP need)?

    Args:
        algorithm: an algorithm's name, with or without ":<int>", or "auto".
        kind: "allreduce" or "scatter".

    Returns:
        True when the algorithm can run that collective.

    Raises:
        ConfigError: a parametric algorithm whose parameter is not an integer in its range
            (``PARAMETER_MAX``): the error says the range, where False would say "unknown".
    """
    if algorithm == "auto":
        # an all-reduce chosen per call by the fitted cost model (reference/auto.py)
        return kind == "allreduce"
    name, sep, _ = algorithm.partition(":") if isinstance(algorithm, str) else ("", "", "")
    if sep and name in PARAMETRIC:
        split_name(algorithm)
    try:
        name = split_name(algorithm)[0]
    except (ConfigError, AttributeError):
        return False
    return name in (ALGORITHMS if kind == "allreduce" else SCATTER_ALGORITHMS)


@lru_cache(maxsize=256)
def allreduce_schedule(algorithm: str, world_size: int) -> Schedule:
    """The all-reduce schedule of ``algorithm`` for ``world_size`` ranks (cached: schedules are
    immutable).

    Args:
        algorithm: a registered all-reduce, with or without ":<int>".
        world_size: the number of ranks.

    Returns:
        The schedule, the same object for the same arguments.

    Raises:
        ConfigError: an unknown algorithm ("native" included: it has no schedule), a bad parameter,
            or world_size < 1.
    """
    if split_name(algorithm)[0] not in ALLREDUCE:  # 'native' too: the engine's own has no schedule
        raise ConfigError(f"no schedule for all-reduce algorithm {algorithm!r}: choose one of "
                          f"{', '.join(ALLREDUCE)} ('native' is the engine's own all-reduce: no "
                          "schedule)")
    fn, extra = lookup(ALLREDUCE, algorithm, "all-reduce")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    return fn(world_size, *extra)
