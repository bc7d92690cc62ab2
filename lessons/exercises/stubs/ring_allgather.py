"""Exercise (lesson 2): the ring all-gather, the second half of the ring all-reduce.

p ranks stand in a ring; the buffer is cut into p chunks. The ring reduce-scatter (your first
exercise) has just run: rank r holds chunk r complete, every rank's part in it exactly once,
and only pieces of the other chunks. Write ``ring_allgather(p)``: the rounds after which every
rank holds every chunk complete, where in every round each rank sends one chunk to its right
neighbour, rank (r + 1) mod p.

    Round(src, dst, chunk, "copy")      # src[i] sends chunk[i] to dst[i], which overwrites its own
    Round(src, dst, chunk, "reduce")    # ... which adds it to its own

A send carries the chunk as it was at the start of the round. The body below writes round 0
only. Which chunk does rank r pass on in round k, does the receiver add or copy, and how many
rounds are needed?

Check it (the simulator runs the reduce-scatter, then your rounds, and counts each rank's part
in every chunk after every round):

    dplab lesson check 2 DIR

Stuck? The lesson's step has hints, one at a time: dplab lesson 2, then h.
"""

from __future__ import annotations

import numpy as np

from dplab.reference.schedule import Round, Schedule


def ring_allgather(p: int) -> Schedule:
    r = np.arange(p)  # every rank at once: one line per round
    rounds = []
    if p > 1:
        rounds.append(Round(r, (r + 1) % p, r, "copy"))  # round 0: rank r sends the chunk it owns
    # TODO: the rounds after round 0
    return Schedule("my_ring_allgather", p, p, rounds)
