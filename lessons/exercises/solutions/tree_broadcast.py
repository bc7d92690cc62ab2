"""Solution (lesson 2): a binomial-tree broadcast as a schedule.

Number the ranks from the root, v = (r - root) mod p. With s the largest power of two below p,
the round of step s has every v that is a multiple of 2s send to v + s (if v + s < p); then s
halves. The holders double every round: ceil(lg p) rounds. It is the binomial reduce's tree,
its arrows reversed and its rounds in the opposite order. The engine's:
dplab/reference/algorithms/tree.py.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer


def tree_broadcast(p: int, root: int = 0) -> Schedule:
    rounds = []
    step = 1
    while step < p:
        step *= 2
    step //= 2  # the largest power of two below p (0 when p = 1: no rounds)
    while step >= 1:
        rounds.append([Transfer((v + root) % p, (v + step + root) % p, 0, "copy")
                       for v in range(0, p - step, 2 * step)])
        step //= 2
    return Schedule("my_tree_broadcast", p, 1, rounds)
