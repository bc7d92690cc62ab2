"""Exercise (lesson 2): a binomial-tree broadcast, written as a schedule.

The root holds a buffer; every other rank must end with a copy of it. One rank sends one
message a round (one port), so the root alone would need p - 1 rounds. Write
``tree_broadcast(p, root)``: every rank that already holds the buffer sends it on to a rank
that does not, so the number of holders doubles each round and ceil(lg p) rounds suffice.
It must work for any p, not only powers of two, and for any root.

The whole buffer travels as one chunk (num_chunks 1, chunk 0), and the receiver copies:

    Schedule(name, world_size, 1, rounds)      # rounds: a list of rounds
    [Transfer(src, dst, 0, "copy"), ...]        # one round: src sends the buffer to dst

The body below writes one round only: the root sends to its right neighbour.

Check it (the simulator follows the root's buffer round by round, for p = 1..9 and several
roots):

    dplab lesson check 2 DIR

Stuck? The lesson's step has hints, one at a time: dplab lesson 2, then h.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def tree_broadcast(p: int, root: int = 0) -> Schedule:
    rounds = []
    if p > 1:
        rounds.append([Transfer(root, (root + 1) % p, 0, "copy")])
    # TODO: the rounds that double the holders until every rank has the buffer
    return Schedule("my_tree_broadcast", p, 1, rounds)
