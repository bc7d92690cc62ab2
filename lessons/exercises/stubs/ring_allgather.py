"""Exercise (lesson 2): the ring all-gather, the second half of the ring all-reduce.

p ranks stand in a ring; the buffer is cut into p chunks. The ring reduce-scatter (your first
exercise) has just run: rank r holds chunk r complete, every rank's part in it exactly once,
and only pieces of the other chunks. Write ``ring_allgather(p)``: the rounds after which every
rank holds every chunk complete, where in every round each rank sends one chunk to its right
neighbour, rank (r + 1) mod p.

    Transfer(src, dst, chunk, "copy")      # src sends its chunk to dst, which overwrites its own
    Transfer(src, dst, chunk, "reduce")  # ... which adds it to its own; a round is a tuple of these

A send carries the chunk as it was at the start of the round. The body below writes round 0
only. Which chunk does rank r pass on in round k, does the receiver add or copy, and how many
rounds are needed?

Check it (the simulator runs the reduce-scatter, then your rounds, and counts each rank's part
in every chunk after every round):

    dplab lesson check 2 DIR

Stuck? The lesson's step has hints, one at a time: dplab lesson 2, then h.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def ring_allgather(p: int) -> Schedule:
    rounds = []
    if p > 1:  # round 0: every rank r sends the chunk it owns to its right neighbour
        rounds.append(tuple(Transfer(r, (r + 1) % p, r, "copy") for r in range(p)))
    # TODO: the rounds after round 0
    return Schedule("my_ring_allgather", p, p, rounds)
