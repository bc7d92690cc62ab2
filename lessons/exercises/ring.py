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
from typing import Any

import numpy as np

from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import Fail, learner_call, load_function
from dplab.lessons.exercises.schedules import plain, rebuild
from dplab.reference.schedule import Schedule
from dplab.reference.simulate import simulate

__all__ = ["WORLD_SIZES", "MAX_TRANSFERS", "judge_ring", "collect_ring", "ring_problem"]

WORLD_SIZES = range(1, 9)
MAX_TRANSFERS = 100_000  # per schedule: the ring needs p(p - 1), 56 at p = 8


def judge_ring(file: Path, output: list[str]) -> str:
    """Run the learner's ring_reduce_scatter for p = 1..8 through the simulator."""
    answer = run_learner("ring_reduce_scatter", file, {"world_sizes": list(WORLD_SIZES)}, output)
    for p, returned in zip(WORLD_SIZES, answer["data"].get("schedules", [])):
        problem = ring_problem(_schedule(returned, p), p)
        if problem:
            raise Fail(f"at p={p}: {problem}")
    if answer["fail"]:
        raise Fail(answer["fail"])
    p = WORLD_SIZES[-1]
    return (f"right for p = 1..{p}: after p - 1 rounds rank r holds chunk r with every rank's part "
            f"exactly once, each rank sending one chunk to its right neighbour per round ({p - 1} "
            f"rounds, {p * (p - 1)} chunk transfers at p={p})")


def collect_ring(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: each p's schedule as plain lists (``out["schedules"]``), or what it was
    instead."""
    fn = load_function(file, "ring_reduce_scatter")
    out["schedules"] = schedules = []
    for p in inputs["world_sizes"]:
        with learner_call(file, f"ring_reduce_scatter({p})"):
            schedule = fn(p)
        schedules.append(plain(schedule, f"ring_reduce_scatter({p})", MAX_TRANSFERS,
                               f"the ring's reduce-scatter needs p(p - 1) = {p * (p - 1)}"))


def _schedule(returned: dict[str, Any], p: int) -> object:
    """The learner's schedule rebuilt here from its lists (checked again), or a stand-in for what
    they returned instead (``ring_problem`` names its type)."""
    sizes = returned.get("world_size"), returned.get("num_chunks")
    if returned["type"] == "Schedule" and sizes != (p, p):  # refused before simulating: say which
        return Schedule(returned["name"], max(sizes[0], 1), max(sizes[1], 1), [])
    return rebuild(returned, f"at p={p}: ring_reduce_scatter returned a schedule that")


def ring_problem(schedule: object, p: int) -> str | None:
    """What is wrong with ``schedule`` as the ring reduce-scatter of ``p`` ranks, in the lesson's
    words."""
    if not isinstance(schedule, Schedule):
        return (f"ring_reduce_scatter returned {type(schedule).__name__}, not a Schedule: "
                "return Schedule(name, p, p, rounds)")
    if schedule.world_size != p:
        return (f"the schedule is for {schedule.world_size} ranks: "
                f"build it for the p = {p} it is asked for")
    if schedule.num_chunks != p:
        return (f"the schedule cuts the buffer into {schedule.num_chunks} chunks: a reduce-scatter "
                f"over {p} ranks needs {p}, one for each rank to own")
    history = simulate(schedule).holdings  # history[i + 1][rank, chunk, contributor]: after round i
    for i, counts in enumerate(history[1:]):
        over = np.argwhere(counts > 1)
        if over.size:
            rank, chunk, part = (int(x) for x in over[0])
            times = _times(counts[rank, chunk, part])
            return (f"rank {rank} ends with chunk {chunk} counted {times} after round {i}: rank "
                    f"{part}'s part is in it {times}, and each rank's part must be added exactly "
                    "once (never send a rank a sum its own part is already in)")
    last = history[-1]
    for rank in range(p):
        if (last[rank, rank] == 1).all():
            continue
        complete = [c for c in range(p) if (last[rank, c] == 1).all()]
        if complete:
            return (f"rank {rank} ends with chunk {complete[0]} complete, not chunk {rank}: rank r "
                    "must end owning chunk r (the executor's convention, and "
                    "reduce_scatter_tensor's); shift the chunk every rank sends by one")
        missing = [j for j in range(p) if last[rank, rank, j] == 0]
        copy = next(
            ((i, t) for i, rnd in enumerate(schedule.rounds) for t in rnd if t.op == "copy"), None
        )
        if copy:  # the parts are lost at a copy, not for want of rounds
            i, t = copy
            return (f"rank {rank} ends with chunk {rank} missing {_parts(missing)}: in round {i} "
                    f"rank {t.src} sends chunk {t.chunk} to rank {t.dst} as a copy, which "
                    f"overwrites the partial sum rank {t.dst} holds; a reduce-scatter adds what it "
                    "receives (op 'reduce')")
        when = (
            f"after the last round (round {len(history) - 2})"
            if len(history) > 1
            else "with no rounds"
        )
        return (f"rank {rank} ends with chunk {rank} missing {_parts(missing)} {when}: a chunk "
                "must travel the whole ring, p - 1 rounds, gathering one part at every rank it "
                "passes")
    return _shape_problem(schedule, p)


def _shape_problem(schedule: Schedule, p: int) -> str | None:
    """A right reduce-scatter that is not the ring: the wrong number of rounds, links or loads."""
    if len(schedule.rounds) != p - 1:
        n = len(schedule.rounds)
        return (f"the chunks end up right, but in {n} round{'s' * (n != 1)}: the ring's "
                f"reduce-scatter takes p - 1 = {p - 1}, every rank sending one chunk per round")
    for i, transfers in enumerate(schedule.rounds):
        sent = [0] * p
        for t in transfers:
            if t.dst != (t.src + 1) % p:
                return (
                    f"in round {i} rank {t.src} sends to rank {t.dst}: in a ring each rank "
                    f"sends only to its right neighbour, rank (r + 1) mod p = {(t.src + 1) % p}"
                )
            sent[t.src] += 1
        for rank, n in enumerate(sent):
            if n != 1:
                return (f"in round {i} rank {rank} sends {n} chunks: in the ring every rank sends "
                        "exactly one chunk per round, so every link is busy and none carries more "
                        "than its share")
    return None


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(int(n), f"{int(n)} times")


def _parts(ranks: list[int]) -> str:
    names = [str(r) for r in ranks]
    if len(names) == 1:
        return f"rank {names[0]}'s part"
    return f"ranks {', '.join(names[:-1])} and {names[-1]}'s parts"
