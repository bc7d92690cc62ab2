"""Solution (lesson 2): the ring reduce-scatter as a schedule.

Round k = 0..p-2: rank r sends chunk (r - k - 1) mod p to rank r + 1, which adds it. The chunk
rank r sends in round k is the one it received in round k - 1 plus its own part, so a chunk
travels around the ring gathering one part per rank, and after p - 1 rounds it arrives, complete,
at the rank that owns it: rank r ends holding chunk r. The engine's: reference/algorithms/ring.py
(dplab.reference.algorithms.ring).
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def ring_reduce_scatter(p: int) -> Schedule:
    # round k
    rounds = [tuple(Transfer(r, (r + 1) % p, (r - k - 1) % p, "reduce") for r in range(p))
              for k in range(p - 1)]
    return Schedule("my_ring_reduce_scatter", p, p, rounds)
