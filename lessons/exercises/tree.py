"""Exercise of lesson 2: a binomial-tree broadcast, written by the learner as a schedule.

    dplab lesson check 2 DIR          # runs DIR/tree_broadcast.py for p = 1..9 and several roots

The learner's ``tree_broadcast(p, root)`` returns a one-chunk ``Schedule`` of copies after which
every rank holds the root's buffer, in ceil(lg p) rounds, no rank sending or receiving more than
one message a round (one port). The simulator follows the root's buffer round by round; the
verdict names the first thing that goes wrong: a send from a rank that does not have the data
yet (rounds in the reduce's order, or the root forgotten), an add instead of a copy, a rank
sending to several at once, a rank never reached, too many rounds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import Fail
from dplab.lessons.exercises.schedules import rebuild
from dplab.reference.schedule import Schedule
from dplab.reference.simulate import simulate

__all__ = ["CALLS", "HINTS", "judge_tree", "broadcast_problem", "lg"]

# root 0 for p = 1..9 (powers of two and not), then roots other than 0
CALLS = [(p, 0) for p in range(1, 10)] + [(5, 2), (6, 5), (8, 3), (9, 4)]
HINTS = (
    "Count who holds the data: 1 rank before round 0. If every rank that holds it sends it to one "
    "rank that does not, how many hold it after each round?",
    "Work in 'virtual ranks' v = (r - root) mod p, so the root is v = 0. In the round with step s "
    "(the largest power of two below p first, halving down to 1), every v that is a multiple of 2s "
    "sends to v + s, if v + s < p.",
    "s = largest power of two < p; while s >= 1: one round of Transfer((v + root) % p, (v + s + "
    "root) % p, 0, 'copy') for v in range(0, p - s, 2 * s); s //= 2.",
)


def lg(p: int) -> int:
    """ceil(lg p): the rounds a binomial broadcast needs (0 for one rank)."""
    return (p - 1).bit_length()


def judge_tree(file: Path, output: list[str]) -> str:
    """Run the learner's tree_broadcast for every (p, root) of CALLS through the simulator."""
    inputs = {"function": "tree_broadcast", "calls": [list(c) for c in CALLS]}
    answer = run_learner("tree_broadcast", file, inputs, output)
    for (p, root), plain in zip(CALLS, answer["data"].get("schedules", [])):
        try:
            problem = broadcast_problem(rebuild(plain), p, root)
        except Fail as e:
            raise Fail(f"at p={p}, root={root}: {e}") from None
        if problem:
            raise Fail(f"at p={p}, root={root}: {problem}")
    if answer["fail"]:
        fail = answer["fail"]
        if "out of range" in fail:
            fail += (": a rank whose partner would be p or more sits that round out (p need not be "
                     "a power of two)")
        raise Fail(fail)
    return ("right for p = 1..9 and roots 0, 2, 3, 4, 5: every rank ends with the root's buffer "
            f"in ceil(lg p) rounds ({lg(9)} at p=9), the ranks that hold it doubling every round, "
            "each sending at most one message a round")


def broadcast_problem(schedule: object, p: int, root: int) -> str | None:
    """What is wrong with ``schedule`` as a binomial broadcast from ``root``, in the lesson's
    words."""
    if not isinstance(schedule, Schedule):
        return (f"tree_broadcast returned {type(schedule).__name__}, not a Schedule: "
                "return Schedule(name, p, 1, rounds)")
    if schedule.world_size != p:
        return (f"the schedule is for {schedule.world_size} ranks: "
                f"build it for the p = {p} it is asked for")
    if schedule.num_chunks != 1:
        return (f"the schedule cuts the buffer into {schedule.num_chunks} chunks: a tree broadcast "
                "sends the whole buffer as one chunk (num_chunks 1, every transfer chunk 0)")
    rounds = schedule.rounds
    have = _holders(schedule, root)  # have[i][rank]: holds the root's buffer after round i - 1
    for i, transfers in enumerate(rounds):
        for t in transfers:
            if t.op == "reduce":
                return (f"in round {i} rank {t.dst} adds what rank {t.src} sends: a broadcast "
                        "copies the root's buffer ('copy'); adding would mix it with the "
                        "receiver's own")
        for t in transfers:
            if not have[i][t.src]:
                return _early_send(schedule, p, root, i, t)
        sent = np.bincount([t.src for t in transfers], minlength=p)
        if sent.max(initial=0) > 1:
            rank = int(sent.argmax())
            return (f"in round {i} rank {rank} sends {int(sent[rank])} messages: a rank sends one "
                    "message a round (one port, and the messages would queue behind each other); "
                    "in a tree every rank that holds the data sends it to one new rank per round, "
                    "so the holders double")
        for t in transfers:
            if have[i][t.dst]:
                return (f"in round {i} rank {t.src} sends to rank {t.dst}, which already holds the "
                        "root's buffer: a wasted send; send only to ranks that do not have it yet")
    missing = [r for r in range(p) if not have[-1][r]]
    if missing:
        when = f"after the last round (round {len(rounds) - 1})" if rounds else "with no rounds"
        lack = f"{len(missing)} of {p} ranks lack" if len(missing) > 1 else f"1 of {p} ranks lacks"
        return (f"rank {missing[0]} never receives the root's buffer ({lack} it {when}): each "
                f"round at most doubles the holders (1, 2, 4, ...), so p = {p} needs ceil(lg p) = "
                f"{lg(p)} rounds, lg p rounded up when p is not a power of two")
    if len(rounds) != lg(p):
        return (f"every rank gets the root's buffer, but in {len(rounds)} rounds: a binomial tree "
                f"needs ceil(lg p) = {lg(p)} at p = {p}; every rank that holds the data must send "
                "it on in every round, so the holders double (1, 2, 4, ...)")
    return None


def _holders(schedule: Schedule, root: int) -> list[np.ndarray]:
    """After each round boundary: which ranks hold exactly the root's buffer."""
    own = np.zeros(schedule.world_size, np.int64)
    own[root] = 1
    return [(h[:, 0, :] == own).all(axis=1) for h in simulate(schedule).holdings]


def _early_send(schedule: Schedule, p: int, root: int, i: int, t) -> str:
    """A send from a rank that does not hold the data yet: say which slip it looks like."""
    text = f"in round {i} rank {t.src} sends before it holds the root's buffer"
    if root != 0 and broadcast_problem(schedule, p, 0) is None:
        return (text + f": your tree broadcasts from rank 0, not from root {root}; number the "
                       "ranks from the "
                "root, v = (r - root) mod p, and turn v back into a rank with (v + root) mod p")
    flipped = Schedule(schedule.name, p, 1, schedule.rounds[::-1])
    if broadcast_problem(flipped, p, root) is None:
        return (text + ": your rounds run in the reduce's order (smallest step first); a broadcast "
                       "starts "
                "at the root, so the round with the largest step comes first")
    return text + (": a rank can pass the data on only after it received it, and in round 0 only "
                   "the root has it")
