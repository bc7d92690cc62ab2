"""Alpha-beta-gamma cost of any schedule, computed by walking the schedule itself.

The model (Hockney, extended with gamma by Thakur, Rabenseifner & Gropp 2005):
sending a message of m bytes costs alpha + m beta; reducing m bytes costs m gamma.
Ports are single and full-duplex: in one round a rank pays alpha per message and
beta per byte for the *larger* of what it sends and what it receives (it can do
both at once, but one message at a time in each direction), plus gamma for every
byte it reduces. A round lasts as long as its slowest rank.

The closed forms from the literature are here too; tests check the walk against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dplab.reference.schedule import Schedule, chunk_bounds

__all__ = ["Cost", "cost", "closed_form"]


@dataclass(frozen=True)
class Cost:
    time: float  # seconds (or whatever unit alpha/beta/gamma are in)
    rounds: int
    bytes_sent_max: int  # the most bytes any one rank sends over the whole schedule
    bytes_recv_max: int


def cost(
    schedule: Schedule, nbytes: int, alpha: float, beta: float, gamma: float, itemsize: int = 1
) -> Cost:
    """Price ``schedule`` for a buffer of ``nbytes`` (cut into chunks of whole ``itemsize`` elements)."""
    p = schedule.world_size
    chunk_bytes = [(b - a) * itemsize for a, b in chunk_bounds(nbytes // itemsize, schedule.num_chunks)]
    total, sent, recv = 0.0, [0] * p, [0] * p
    for rnd in schedule.rounds:
        msgs_out, msgs_in = [0] * p, [0] * p
        out, inn, reduced = [0] * p, [0] * p, [0] * p
        for t in rnd:
            m = chunk_bytes[t.chunk]
            msgs_out[t.src] += 1
            msgs_in[t.dst] += 1
            out[t.src] += m
            inn[t.dst] += m
            if t.op == "reduce":
                reduced[t.dst] += m
        total += max(
            alpha * max(msgs_out[r], msgs_in[r]) + beta * max(out[r], inn[r]) + gamma * reduced[r]
            for r in range(p)
        )
        sent = [s + o for s, o in zip(sent, out)]
        recv = [s + i for s, i in zip(recv, inn)]
    return Cost(total, len(schedule.rounds), max(sent), max(recv))


def closed_form(algorithm: str, p: int, n: float, alpha: float, beta: float, gamma: float) -> float:
    """Textbook all-reduce times for n bytes (tree: exact for powers of two)."""
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
    raise ValueError(f"no closed form for {algorithm!r}")
