"""Exercise of lesson 2: the ring reduce-scatter, written by the learner as a schedule.

    dplab lesson check 2 DIR          # runs DIR/ring_reduce_scatter.py for p = 1..8

The learner's ``ring_reduce_scatter(p)`` returns a ``Schedule``; the simulator
(``dplab.reference.simulate``) runs it and counts, for every rank and chunk, how many times each
rank's part was added in after each round. Those counts are what the verdict is made of:
"rank 2 ends with chunk 1 counted twice after round 3", "rank 0 ends with chunk 0 missing
rank 2's part". A right answer is then held to the ring's shape: p - 1 rounds, each rank sending
one chunk to its right neighbour per round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dplab.lessons.exercises.learner import Fail, learner_call, load_function
from dplab.reference.schedule import Schedule
from dplab.reference.simulate import simulate

__all__ = ["WORLD_SIZES", "judge_ring", "ring_problem"]

WORLD_SIZES = range(1, 9)


def judge_ring(file: Path) -> str:
    """Run the learner's ring_reduce_scatter for p = 1..8 through the simulator."""
    fn = load_function(file, "ring_reduce_scatter")
    for p in WORLD_SIZES:
        with learner_call(file, f"ring_reduce_scatter({p})"):
            schedule = fn(p)
        problem = ring_problem(schedule, p)
        if problem:
            raise Fail(f"at p={p}: {problem}")
    p = WORLD_SIZES[-1]
    return (f"right for p = 1..{p}: after p - 1 rounds rank r holds chunk r with every rank's part exactly "
            f"once, each rank sending one chunk to its right neighbour per round ({p - 1} rounds, "
            f"{p * (p - 1)} chunk transfers at p={p})")


def ring_problem(schedule: object, p: int) -> str | None:
    """What is wrong with ``schedule`` as the ring reduce-scatter of ``p`` ranks, in the lesson's words."""
    if not isinstance(schedule, Schedule):
        return (f"ring_reduce_scatter returned {type(schedule).__name__}, not a Schedule: "
                "return Schedule(name, p, p, rounds)")
    if schedule.world_size != p:
        return f"the schedule is for {schedule.world_size} ranks: build it for the p = {p} it is asked for"
    if schedule.num_chunks != p:
        return (f"the schedule cuts the buffer into {schedule.num_chunks} chunks: a reduce-scatter over "
                f"{p} ranks needs {p}, one for each rank to own")
    history = simulate(schedule).holdings  # history[i + 1][rank, chunk, contributor]: after round i
    for i, counts in enumerate(history[1:]):
        over = np.argwhere(counts > 1)
        if over.size:
            rank, chunk, part = (int(x) for x in over[0])
            times = _times(counts[rank, chunk, part])
            return (f"rank {rank} ends with chunk {chunk} counted {times} after round {i}: rank {part}'s "
                    f"part is in it {times}, and each rank's part must be added exactly once (never send a "
                    "rank a sum its own part is already in)")
    last = history[-1]
    for rank in range(p):
        if (last[rank, rank] == 1).all():
            continue
        complete = [c for c in range(p) if (last[rank, c] == 1).all()]
        if complete:
            return (f"rank {rank} ends with chunk {complete[0]} complete, not chunk {rank}: rank r must end "
                    "owning chunk r (the executor's convention, and reduce_scatter_tensor's); shift the "
                    "chunk every rank sends by one")
        missing = [j for j in range(p) if last[rank, rank, j] == 0]
        when = f"after the last round (round {len(history) - 2})" if len(history) > 1 else "with no rounds"
        return (f"rank {rank} ends with chunk {rank} missing {_parts(missing)} {when}: a chunk must travel "
                "the whole ring, p - 1 rounds, gathering one part at every rank it passes")
    return _shape_problem(schedule, p)


def _shape_problem(schedule: Schedule, p: int) -> str | None:
    """A right reduce-scatter that is not the ring: the wrong number of rounds, links or loads."""
    if len(schedule.rounds) != p - 1:
        n = len(schedule.rounds)
        return (f"the chunks end up right, but in {n} round{'s' * (n != 1)}: the ring's reduce-scatter "
                f"takes p - 1 = {p - 1}, every rank sending one chunk per round")
    for i, transfers in enumerate(schedule.rounds):
        sent = [0] * p
        for t in transfers:
            if t.dst != (t.src + 1) % p:
                return (f"in round {i} rank {t.src} sends to rank {t.dst}: in a ring each rank sends only "
                        f"to its right neighbour, rank (r + 1) mod p = {(t.src + 1) % p}")
            sent[t.src] += 1
        for rank, n in enumerate(sent):
            if n != 1:
                return (f"in round {i} rank {rank} sends {n} chunks: in the ring every rank sends exactly "
                        "one chunk per round, so every link is busy and none carries more than its share")
    return None


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(int(n), f"{int(n)} times")


def _parts(ranks: list[int]) -> str:
    names = [str(r) for r in ranks]
    if len(names) == 1:
        return f"rank {names[0]}'s part"
    return f"ranks {', '.join(names[:-1])} and {names[-1]}'s parts"
