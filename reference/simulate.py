"""Run a schedule in one process over p arrays: the executor's twin, and every algorithm's oracle.

What the executor (``collectives.run_schedule``) does with bytes, one rank per process over a
``Communicator``, this does for all p ranks at once: the same rounds, the same transfers, a send
carrying its chunk as the round found it. Besides the values, the simulator tracks *provenance*:
for every rank and chunk, how many times each rank's contribution has been added into it. A
correct all-reduce ends with every chunk on every rank holding each contribution exactly once;
counting (not just comparing sums) catches double counting that a lucky sum would hide. The
per-round snapshots are what the visualizer animates.

    >>> from dplab.reference.algorithms import allreduce_schedule
    >>> sim = simulate(allreduce_schedule("ring", 4))
    >>> bool((sim.holdings[-1] == 1).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dplab.reference.schedule import Schedule, chunk_bounds

__all__ = ["Simulation", "simulate", "is_allreduce", "initial_holdings"]


@dataclass
class Simulation:
    """What ``simulate`` found: who holds whose contribution after every round, and the values.

    Args:
        schedule: the schedule simulated.
        holdings: per round boundary (before round 0 and after each), ``counts[rank, chunk,
            contributor]``: how many times each rank's contribution is in that chunk there.
        buffers: the final buffers, if ``simulate`` was given some; else None.
    """
    schedule: Schedule
    holdings: list[np.ndarray]  # per round boundary: counts[rank, chunk, contributor]
    buffers: list[np.ndarray] | None  # final values, if buffers were given


def initial_holdings(p: int, k: int) -> np.ndarray:
    """Before any round, rank r's chunks each hold only r's own contribution.

    Args:
        p: the number of ranks.
        k: the number of chunks.

    Returns:
        ``counts[rank, chunk, contributor]``, 1 where rank == contributor.
    """
    h = np.zeros((p, k, p), dtype=np.int64)
    for r in range(p):
        h[r, :, r] = 1
    return h


def simulate(schedule: Schedule, buffers: list[np.ndarray] | None = None) -> Simulation:
    """Apply every round; a send carries the chunk as it was at the start of the round (so two
    ranks may exchange one chunk in one round: recursive doubling). Provenance moves per round
    as whole arrays (p = 64 in milliseconds); values chunk by chunk.

    Args:
        schedule: the schedule to run.
        buffers: one array per rank (any shape; flattened), or None to track provenance only.

    Returns:
        The holdings after every round, and the final buffers when given.

    Raises:
        ValueError: ``buffers`` does not hold one array per rank.
    """
    p, k = schedule.world_size, schedule.num_chunks
    history = [initial_holdings(p, k)]
    bufs = None
    if buffers is not None:
        if len(buffers) != p:
            raise ValueError(f"need {p} buffers, got {len(buffers)}")
        bufs = np.stack([np.array(b, copy=True).reshape(-1) for b in buffers])
        bounds = chunk_bounds(bufs.shape[1], k)
    for rnd in schedule.rounds:
        before = history[-1]  # the state at the start of the round: what every send carries
        holding = before.copy()
        if rnd:
            src, dst, chunk, red = (
                np.array(c) for c in zip(*((t.src, t.dst, t.chunk, t.op == "reduce") for t in rnd))
            )
            # validate() refuses a copy into a chunk that anything else lands in that round
            cp = ~red
            holding[dst[cp], chunk[cp]] = before[src[cp], chunk[cp]]
            np.add.at(holding, (dst[red], chunk[red]), before[src[red], chunk[red]])
        if bufs is not None:
            values = bufs.copy()
            for t in rnd:
                a, b = bounds[t.chunk]
                if t.op == "reduce":
                    bufs[t.dst, a:b] += values[t.src, a:b]
                else:
                    bufs[t.dst, a:b] = values[t.src, a:b]
        history.append(holding)
    return Simulation(schedule, history, list(bufs) if bufs is not None else None)


def is_allreduce(sim: Simulation) -> bool:
    """Every chunk on every rank holds every rank's contribution exactly once.

    Args:
        sim: a finished simulation.

    Returns:
        True when the schedule computed an all-reduce.
    """
    return bool((sim.holdings[-1] == 1).all())
