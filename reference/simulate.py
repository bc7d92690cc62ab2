"""Run a schedule in one process over p arrays: the oracle for every algorithm.

Besides the values, the simulator tracks *provenance*: for every rank and chunk,
how many times each rank's contribution has been added into it. A correct
all-reduce ends with every chunk on every rank holding each contribution exactly
once; counting (not just comparing sums) catches double counting that a lucky sum
would hide. The per-round snapshots are what the visualizer animates.

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
    schedule: Schedule
    holdings: list[np.ndarray]  # per round boundary: counts[rank, chunk, contributor]
    buffers: list[np.ndarray] | None  # final values, if buffers were given


def initial_holdings(p: int, k: int) -> np.ndarray:
    """Before any round, rank r's chunks each hold only r's own contribution."""
    h = np.zeros((p, k, p), dtype=np.int64)
    for r in range(p):
        h[r, :, r] = 1
    return h


def simulate(schedule: Schedule, buffers: list[np.ndarray] | None = None) -> Simulation:
    """Apply every round; a send carries the chunk as it was at the start of the round."""
    p, k = schedule.world_size, schedule.num_chunks
    holding = initial_holdings(p, k)
    history = [holding.copy()]
    bufs = None
    if buffers is not None:
        if len(buffers) != p:
            raise ValueError(f"need {p} buffers, got {len(buffers)}")
        bufs = [np.array(b, copy=True).reshape(-1) for b in buffers]
        bounds = chunk_bounds(bufs[0].size, k)
    for rnd in schedule.rounds:
        before = holding.copy()
        values = [b.copy() for b in bufs] if bufs is not None else None
        for t in rnd:
            if t.op == "reduce":
                holding[t.dst, t.chunk] += before[t.src, t.chunk]
            else:
                holding[t.dst, t.chunk] = before[t.src, t.chunk]
            if bufs is not None:
                a, b = bounds[t.chunk]
                if t.op == "reduce":
                    bufs[t.dst][a:b] += values[t.src][a:b]
                else:
                    bufs[t.dst][a:b] = values[t.src][a:b]
        history.append(holding.copy())
    return Simulation(schedule, history, bufs)


def is_allreduce(sim: Simulation) -> bool:
    """Every chunk on every rank holds every rank's contribution exactly once."""
    return bool((sim.holdings[-1] == 1).all())
