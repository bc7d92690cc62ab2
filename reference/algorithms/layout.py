"""The node layout a launcher gives, and what ``hierarchical`` means on it.

``comm.hosts`` (``dplab.reference.communicator.Communicator.hosts``) is a tuple with each rank's
host index: ``(0, 0, 1, 1)`` is 2 hosts x 2 ranks. The hierarchical schedule groups consecutive
ranks into nodes of g (rank r on node r // g, the last node possibly smaller), which is how
mpiexec, torchrun and Slurm's block distribution place ranks. ``resolve`` turns the name a user
wrote into the schedule to run, before any executor sees it:

- one host (dplab's own ``launch``, or a launcher job on one machine): there are no real nodes,
  so ``hierarchical`` keeps its registry default (``hierarchical.NODE_SIZE`` simulated nodes) and
  ``hierarchical:g`` any g: on a laptop the two levels are a lesson, not a fact to contradict.
  (g = p, one node, would be the plain ring: a synonym that teaches nothing.)
- several hosts: ``hierarchical`` is ``hierarchical:<ranks per host>``; ``hierarchical:g`` with
  another g, or hosts the schedule cannot describe (not consecutive ranks, or a host other than
  the last one smaller), is a ``ConfigError`` in one line: its "intra-node" rounds would cross
  the slow links, which is the opposite of what the schedule is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from dplab.reference.errors import ConfigError

__all__ = ["one_host", "host_sizes", "node_size", "resolve", "describe"]

_NAME = "hierarchical"


def one_host(world_size: int) -> tuple[int, ...]:
    """Every rank on host 0: the layout of dplab's own launch and of any single machine.

    Args:
        world_size: the number of ranks.

    Returns:
        A host key per rank, all 0.
    """
    return (0,) * world_size


def host_sizes(hosts: Sequence[int]) -> list[int]:
    """Ranks per host, hosts in the order of their first rank.

    Args:
        hosts: each rank's host key, in rank order.

    Returns:
        The number of ranks on each host.
    """
    seen: dict[int, int] = {}
    for h in hosts:
        seen[h] = seen.get(h, 0) + 1
    return list(seen.values())


@lru_cache(maxsize=64)
def node_size(hosts: tuple[int, ...]) -> int | None:
    """g when ``hosts`` is nodes of g consecutive ranks (rank r on r // g, the last possibly
    smaller; one host: g = p), else None (a layout the hierarchical schedule cannot describe).

    Args:
        hosts: each rank's host key, in rank order.

    Returns:
        g, or None.
    """
    if not hosts:
        return None
    g = hosts.count(hosts[0])
    blocks = [hosts[r] for r in range(0, len(hosts), g)]
    same = all(hosts[r] == blocks[r // g] for r in range(len(hosts)))
    return g if same and len(set(blocks)) == len(blocks) else None


def describe(hosts: Sequence[int]) -> str:
    """The layout in words: "2 hosts of 2 ranks", "2 hosts of 3, 1 ranks".

    Args:
        hosts: each rank's host key, in rank order.

    Returns:
        The layout as a short phrase for error messages.
    """
    sizes = host_sizes(hosts)
    each = str(sizes[0]) if len(set(sizes)) == 1 else ", ".join(map(str, sizes))
    hosts_word = "host" if len(sizes) == 1 else "hosts"
    ranks_word = "ranks" if max(sizes) > 1 else "rank"
    return f"{len(sizes)} {hosts_word} of {each} {ranks_word}"


@lru_cache(maxsize=256)
def _resolve(algorithm: str, hosts: tuple[int, ...]) -> str:
    name, _, param = algorithm.partition(":")
    if name != _NAME or len(set(hosts)) <= 1:
        return algorithm
    g = node_size(hosts)
    if g is None:
        raise ConfigError(f"{algorithm} needs consecutive ranks on each host (rank r on host r // "
                          f"g), but the launcher placed them {list(hosts)}: use another algorithm, "
                          "or a launcher's block placement")
    if param.isdigit() and int(param) != g:  # a bad parameter is split_name's to report
        raise ConfigError(f"{algorithm} puts {param} ranks in a node, but the launcher put "
                          f"{describe(hosts)}: use --algorithm {_NAME} (g from the hosts) or "
                          f"{_NAME}:{g}")
    return f"{_NAME}:{g}"


def resolve(algorithm: str, hosts: Sequence[int]) -> str:
    """The schedule name to run for ``algorithm`` on ranks placed on ``hosts`` (module docstring);
    any other algorithm, and "auto", unchanged.

    Args:
        algorithm: an algorithm name as a user gives it ("hierarchical", "hierarchical:4", ...).
        hosts: each rank's host key, in rank order.

    Returns:
        The algorithm to run; "hierarchical" on several hosts becomes "hierarchical:<g>".

    Raises:
        ConfigError: the hosts are not blocks of consecutive ranks, or the name's g differs from
            the hosts'.
    """
    if not algorithm.startswith(_NAME):  # the common case costs one string comparison
        return algorithm
    return _resolve(algorithm, tuple(hosts))
