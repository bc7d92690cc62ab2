"""Solution (lesson 2): the ring all-gather as a schedule.

Round k = 0..p-2: rank r sends chunk (r - k) mod p to rank r + 1, which copies it. Round 0
sends the chunk the reduce-scatter left complete on rank r; every later round passes on the
chunk that arrived the round before. Each rank lacks p - 1 chunks and receives one a round, so
p - 1 rounds. The engine's: reference/algorithms/ring.py (dplab.reference.algorithms.ring).
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def ring_allgather(p: int) -> Schedule:
    rounds = [tuple(Transfer(r, (r + 1) % p, (r - k) % p, "copy") for r in range(p))  # round k
              for k in range(p - 1)]
    return Schedule("my_ring_allgather", p, p, rounds)
