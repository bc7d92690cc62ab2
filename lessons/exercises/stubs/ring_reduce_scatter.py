"""Exercise (lesson 2): the ring reduce-scatter, written as a schedule.

p ranks stand in a ring; each holds a buffer cut into p chunks (chunk c of rank r is r's part of
chunk c). Write ``ring_reduce_scatter(p)``: the rounds after which rank r holds chunk r summed
over all ranks, every rank's part counted exactly once, where in every round each rank sends one
chunk to its right neighbour, rank (r + 1) mod p, which adds it to its own copy of that chunk.

A schedule is data (read dplab/reference/schedule.py):

    Schedule(name, world_size, num_chunks, rounds)     # rounds: a list of rounds
    Transfer(src, dst, chunk, "reduce")                # src sends its chunk to dst, which adds it
                                                       # to its own; a round is a tuple of these

A send carries the chunk as it was at the start of the round, including everything added into
it in earlier rounds. The body below writes round 0 only. Which chunk does rank r pass on in
round k, and how many rounds does the ring need?

Check it (the simulator counts each rank's part in each chunk after every round):

    dplab lesson check 2 DIR
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def ring_reduce_scatter(p: int) -> Schedule:
    rounds = []
    if p > 1:  # round 0: every rank r sends chunk r - 1 to its right neighbour
        rounds.append(tuple(Transfer(r, (r + 1) % p, (r - 1) % p, "reduce") for r in range(p)))
    # TODO: the rounds after round 0
    return Schedule("my_ring_reduce_scatter", p, p, rounds)
