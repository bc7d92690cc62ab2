"""Alpha-beta-gamma cost of any schedule, computed from the schedule itself, on any topology.

A message (a round's consecutive chunks from one rank to one peer, ``schedule.messages``) of m
bytes costs alpha + m beta, reducing m bytes m gamma. Per round a rank pays, on each full-duplex
port (``dplab.reference.topology``), for the larger of what it sends and receives there; its
ports work at once; a round lasts as long as its slowest rank. ``Topology.flat`` is the classic
single-port model.

    cost(allreduce_schedule("ring", 8), 1 << 20, 5e-6, 1e-10, 0.0).time
    cost(allreduce_schedule("hierarchical:8", 64), 1 << 20, topology=PRESETS["dgx-h100"]).time
    curve(allreduce_schedule("ring", 256), [1 << 10, 1 << 20, 1 << 30], PRESETS["dgx-h100"], 4)

At p = 4096 build the p^2 schedules with the engine's array builders (``best_regions(...,
builders=dplab.backends.fastpath.arrays.ALLREDUCE)``): the readable ones take minutes there.

``curve`` prices many sizes from one per-round summary (``cost_cells``), chunks rounded up to
equal sizes (an upper bound); ``cost`` prices uneven chunks exactly. The closed forms from the
literature are here too, and tests check the walk against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.reference.columns import RoundTable, columns
from dplab.reference.cost_cells import FIELDS, cell_blocks
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, chunk_bounds
from dplab.reference.topology import Topology

__all__ = ["Cost", "cost", "curve", "closed_form", "Summary", "summarize", "Regions",
           "best_regions", "region_algorithms"]


@dataclass(frozen=True)
class Cost:
    """A schedule's price: its time, its rounds, and the most bytes one rank sends and receives.

    Args:
        time: seconds (in the unit of alpha, beta, gamma).
        rounds: the schedule's rounds.
        bytes_sent_max: the most bytes one rank sends over the schedule.
        bytes_recv_max: the most bytes one rank receives.
    """
    time: float  # seconds (or whatever unit alpha/beta/gamma are in)
    rounds: int
    bytes_sent_max: int  # the most bytes any one rank sends over the whole schedule
    bytes_recv_max: int


@dataclass(frozen=True, eq=False)
class Summary:
    """A schedule as the cost model sees it on one node size, whatever the message size.

    Row q is a cell shape some rank has in round ``round[q]`` (``fields[q]``: FIELDS in chunks);
    rows are sorted by round and ``first`` is where each round's rows begin.

    Args:
        rounds: the schedule's rounds.
        round: each row's round.
        fields: each row's FIELDS, in chunks.
        first: where each round's rows begin.
        sent_chunks: chunks each rank sends over the schedule.
        recv_chunks: chunks each rank receives.
    """

    rounds: int
    round: np.ndarray
    fields: np.ndarray  # (rows, 5) int64
    first: np.ndarray
    sent_chunks: np.ndarray  # per rank, over the whole schedule
    recv_chunks: np.ndarray


def summarize(schedule: Schedule | RoundTable, ranks_per_node: int) -> Summary:
    """The summary of ``schedule`` (computed once per schedule and node size, then kept).

    Args:
        schedule: a schedule, or its table.
        ranks_per_node: ranks per node (clipped to 1..world_size).

    Returns:
        The summary.
    """
    g = min(max(ranks_per_node, 1), schedule.world_size)
    return schedule.memo(("cost-summary", g), lambda: _summarize(schedule, g))


def _summarize(schedule: Schedule | RoundTable, g: int) -> Summary:
    t, p = columns(schedule), schedule.world_size
    rounds, fields = [], []
    for r0, _, cells in cell_blocks(schedule, g):
        r, u = _distinct_per_round([cells[name] for name in FIELDS])
        rounds.append(r + r0)
        fields.append(u)
    rnd = np.concatenate(rounds) if rounds else np.zeros(0, np.int64)
    fld = np.concatenate(fields) if fields else np.zeros((0, len(FIELDS)), np.int64)
    first = np.flatnonzero(np.r_[True, rnd[1:] != rnd[:-1]]) if rnd.size else np.zeros(0, np.int64)
    return Summary(
        len(t), rnd, fld, first, np.bincount(t.src, minlength=p), np.bincount(t.dst, minlength=p)
    )


def _distinct_per_round(f: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(round, fields) rows, one per distinct cell shape in each round; ``f``:
    FIELDS as (rounds, p)."""
    nr, p = f[0].shape
    bits = [int(a.max()).bit_length() if a.size else 0 for a in f]
    total = sum(bits)
    if total + nr.bit_length() > 62:  # too wide to pack: sort rows
        rows = np.stack([np.repeat(np.arange(nr), p)] + [a.ravel() for a in f], axis=1).astype(
            np.int64
        )
        u = np.unique(rows, axis=0)
        return u[:, 0], u[:, 1:]
    key = np.repeat(np.arange(nr, dtype=np.int64), p)
    for a, b in zip(f, bits):
        key <<= b
        key |= a.ravel().astype(np.int64, copy=False)
    key = (
        np.flatnonzero(np.bincount(key, minlength=1)) if nr << total <= 1 << 24 else np.unique(key)
    )
    out, shift = np.empty((key.size, len(bits)), np.int64), 0
    for i in reversed(range(len(bits))):
        out[:, i] = (key >> shift) & ((1 << bits[i]) - 1)
        shift += bits[i]
    return key >> total, out


def _price(s: Summary, chunk_bytes: np.ndarray, topo: Topology) -> np.ndarray:
    """Seconds for each uniform chunk size in ``chunk_bytes`` (S,)."""
    if not s.round.size:
        return np.zeros(chunk_bytes.shape)
    f, b = s.fields.astype(float), np.asarray(chunk_bytes, float)[None, :]
    intra = topo.intra.alpha * f[:, 0:1] + topo.intra.beta * f[:, 1:2] * b
    inter = topo.inter.alpha * f[:, 2:3] + topo.inter.beta * f[:, 3:4] * b
    cell = np.maximum(intra, inter) + topo.gamma * f[:, 4:5] * b
    return np.maximum.reduceat(cell, s.first, axis=0).sum(axis=0)


def _topology(alpha: Any, beta: Any, gamma: Any, topology: Topology | None) -> Topology:
    if topology is not None:
        if not (alpha is None and beta is None and gamma is None):
            raise ConfigError("give either alpha, beta, gamma (one level) or topology=, not both")
        return topology
    if alpha is None or beta is None or gamma is None:
        raise ConfigError("cost needs alpha, beta and gamma, or topology=Topology(...)")
    return Topology.flat(alpha, beta, gamma)


def cost(
    schedule: Schedule | RoundTable,
    nbytes: int,
    alpha: float | None = None,
    beta: float | None = None,
    gamma: float | None = None,
    itemsize: int = 1,
    *,
    topology: Topology | None = None,
) -> Cost:
    """Price ``schedule`` for a buffer of ``nbytes`` (cut into chunks of whole ``itemsize``
    elements), on one level (alpha, beta, gamma) or on ``topology``. Exact for every size.

    Args:
        schedule: a schedule, or its table.
        nbytes: the buffer's bytes.
        alpha: seconds per message (one level).
        beta: seconds per byte (one level).
        gamma: seconds per byte reduced (one level).
        itemsize: bytes per element.
        topology: a two-level machine, instead of alpha, beta, gamma.

    Returns:
        The time, rounds, and the most bytes one rank sends and receives.

    Raises:
        ConfigError: neither alpha, beta, gamma nor a topology, or both.
    """
    topo = _topology(alpha, beta, gamma, topology)
    k, n = schedule.num_chunks, nbytes // itemsize
    s = summarize(schedule, topo.ranks_per_node)
    if n % k == 0:
        b = n // k * itemsize
        time = float(_price(s, np.array([b]), topo)[0])
        return Cost(time, s.rounds, int(s.sent_chunks.max()) * b, int(s.recv_chunks.max()) * b)
    chunk_bytes = np.array([(hi - lo) * itemsize for lo, hi in chunk_bounds(n, k)], dtype=float)
    time = 0.0
    for _, _, c in cell_blocks(
        schedule, min(topo.ranks_per_node, schedule.world_size), chunk_bytes
    ):
        intra = topo.intra.alpha * c["m_intra"] + topo.intra.beta * c["x_intra"]
        inter = topo.inter.alpha * c["m_inter"] + topo.inter.beta * c["x_inter"]
        time += float((np.maximum(intra, inter) + topo.gamma * c["red"]).max(axis=1).sum())
    t, p = columns(schedule), schedule.world_size
    sent = np.bincount(t.src, chunk_bytes[t.chunk], minlength=p)
    recv = np.bincount(t.dst, chunk_bytes[t.chunk], minlength=p)
    return Cost(time, s.rounds, int(sent.max()), int(recv.max()))


def curve(
    schedule: Schedule | RoundTable, sizes: Any, topology: Topology, itemsize: int = 1
) -> np.ndarray:
    """Seconds for each of ``sizes`` (bytes) at once. A size whose element count is not a multiple
    of the chunk count is priced as the next multiple (every chunk at its largest): exact for the
    others, an upper bound within one element per chunk for these (``cost`` is exact for all).

    Args:
        schedule: a schedule, or its table.
        sizes: buffer sizes in bytes.
        topology: the machine.
        itemsize: bytes per element.

    Returns:
        Seconds, one per size.
    """
    n = np.asarray(sizes, dtype=np.int64) // itemsize
    k = schedule.num_chunks
    return _price(summarize(schedule, topology.ranks_per_node), -(-n // k) * itemsize, topology)


@dataclass(frozen=True, eq=False)
class Regions:
    """Seconds of every algorithm at every (p, size): ``times[a, i, j]`` for ``algorithms[a]``,
    ``ps[i]``, ``sizes[j]``; ``winner[i, j]`` is the index of the cheapest.

    Args:
        topology: the machine priced.
        algorithms: the algorithms compared.
        ps: the world sizes.
        sizes: the buffer sizes in bytes.
        times: seconds, (algorithms, ps, sizes).
    """

    topology: Topology
    algorithms: tuple[str, ...]
    ps: tuple[int, ...]
    sizes: tuple[int, ...]
    times: np.ndarray

    @property
    def winner(self) -> np.ndarray:
        return np.argmin(self.times, axis=0)

    def table(self) -> str:
        """The winner per (p, size) as text: one row per p, one column per size.

        Returns:
            The table, lines joined by newlines.
        """
        names = [_short(s) for s in self.sizes]
        width = max(len(a) for a in self.algorithms)
        lines = ["p \\ size".ljust(7) + " ".join(n.rjust(width) for n in names)]
        for i, p in enumerate(self.ps):
            lines.append(
                str(p).ljust(7) + " ".join(self.algorithms[w].rjust(width) for w in self.winner[i])
            )
        return "\n".join(lines)


def _short(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes}B"


def region_algorithms(topology: Topology) -> tuple[str, ...]:
    """Every registered all-reduce, a parametric one at its default; hierarchical with the
    topology's node size (with one rank per node it is the ring, so it is left out).

    Args:
        topology: the machine.

    Returns:
        Algorithm names, in registry order.
    """
    from dplab.reference.algorithms import ALLREDUCE

    names = [a for a in ALLREDUCE if a != "hierarchical"]
    if topology.ranks_per_node > 1 and "hierarchical" in ALLREDUCE:
        names.append(f"hierarchical:{topology.ranks_per_node}")
    return tuple(names)


def best_regions(topology: Topology, ps: Any, sizes: Any, algorithms: Any = None,
                 itemsize: int = 4, builders: Any = None) -> Regions:
    """Price ``algorithms`` (default ``region_algorithms``) at every p and size on ``topology`` with
    ``curve`` (sizes rounded up to whole chunks). Schedules are built and dropped one at a time,
    not cached: the ring at p = 4096 alone is 235 MB of columns. ``builders``: name -> builder
    to use instead of the registry's, same arguments (an engine's array builder, held equal to
    the readable one).

    Args:
        topology: the machine.
        ps: world sizes.
        sizes: buffer sizes in bytes.
        algorithms: the algorithms to compare (default: ``region_algorithms``).
        itemsize: bytes per element.
        builders: name -> schedule builder, or None for the registry's.

    Returns:
        The times and winners.

    Raises:
        ConfigError: an unknown algorithm.
    """
    from dplab.reference.algorithms import ALLREDUCE, lookup, split_name

    algs = tuple(algorithms or region_algorithms(topology))
    sz = np.asarray(sizes, dtype=np.int64)
    times = np.empty((len(algs), len(ps), sz.size))
    for a, name in enumerate(algs):
        fn, extra = lookup(ALLREDUCE, name, "all-reduce")
        fn = (builders or {}).get(split_name(name)[0], fn)
        for i, p in enumerate(ps):
            times[a, i] = curve(fn(int(p), *extra), sz, topology, itemsize)
    return Regions(topology, algs, tuple(int(p) for p in ps), tuple(int(s) for s in sz), times)


def closed_form(algorithm: str, p: int, n: float, alpha: float, beta: float, gamma: float) -> float:
    """Textbook all-reduce times for n bytes (tree: exact for powers of two).

    Args:
        algorithm: "ring", "tree", "naive", "direct", "recursive_doubling" or "rabenseifner".
        p: the number of ranks.
        n: the buffer's bytes.
        alpha: seconds per message.
        beta: seconds per byte.
        gamma: seconds per byte reduced.

    Returns:
        Seconds.

    Raises:
        ValueError: an algorithm with no closed form here.
    """
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    if algorithm == "tree":
        lg = math.ceil(math.log2(p))
        return 2 * lg * alpha + 2 * n * lg * beta + n * lg * gamma
    if algorithm == "naive":
        return 2 * (p - 1) * alpha + 2 * (p - 1) * n * beta + (p - 1) * n * gamma
    if algorithm == "direct":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    m, fold = p.bit_length() - 1, p & (p - 1) != 0  # p' = 2^m ranks after the fold (MPICH's)
    if algorithm == "recursive_doubling":  # the fold: a reducing round and a copying round more
        return (m + 2 * fold) * (alpha + n * beta) + (m + fold) * n * gamma
    if algorithm == "rabenseifner":  # exact when p' divides n
        q = 1 << m
        return ((2 * m + 2 * fold) * alpha + (2 * (q - 1) / q + 2 * fold) * n * beta
                + ((q - 1) / q + fold) * n * gamma)
    raise ValueError(f"no closed form for {algorithm!r}")
