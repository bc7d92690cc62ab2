"""Exercise of lesson 2: the ring all-gather, the all-reduce's second half, written by the learner.

    dplab lesson check 2 DIR          # runs DIR/ring_allgather.py for p = 1..8

The learner's ``ring_allgather(p)`` returns a ``Schedule``. It starts where the ring
reduce-scatter ends: rank r holds chunk r complete (every rank's part in it once) and only
pieces of the others. The simulator runs the engine's reduce-scatter and then the learner's
rounds, counting each rank's part in every chunk after every round; the verdict names the
first thing that goes wrong: a chunk added instead of copied, a send to the wrong neighbour,
a chunk sent before its sender holds it complete, a rank left without a chunk, a wasted round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dplab.lessons.exercises.child import run_learner
from dplab.lessons.exercises.learner import Fail
from dplab.lessons.exercises.schedules import parts, rebuild
from dplab.reference.algorithms import ring
from dplab.reference.schedule import Schedule, concat
from dplab.reference.simulate import simulate

__all__ = ["WORLD_SIZES", "HINTS", "judge_ring_allgather", "allgather_problem"]

WORLD_SIZES = range(1, 9)
# asked for one at a time: a nudge, then the idea, then nearly the line
HINTS = (
    "After the reduce-scatter, which chunk is complete on rank r? That is the one rank r can send "
    "first.",
    "In every later round a rank passes on the chunk it received in the round before, unchanged: "
    "nothing is added any more, so the receiver copies ('copy').",
    "Round k: rank r sends chunk (r - k) mod p to rank (r + 1) mod p, for k = 0 .. p - 2.",
)


def judge_ring_allgather(file: Path, output: list[str]) -> str:
    """Run the learner's ring_allgather for p = 1..8 after the engine's reduce-scatter."""
    inputs = {"function": "ring_allgather", "calls": [[p] for p in WORLD_SIZES]}
    answer = run_learner("ring_allgather", file, inputs, output)
    for p, plain in zip(WORLD_SIZES, answer["data"].get("schedules", [])):
        try:
            problem = allgather_problem(rebuild(plain), p)
        except Fail as e:
            raise Fail(f"at p={p}: {e}") from None
        if problem:
            raise Fail(f"at p={p}: {problem}")
    if answer["fail"]:
        raise Fail(answer["fail"])
    p = WORLD_SIZES[-1]
    return (f"right for p = 1..{p}: starting from the reduce-scatter (rank r holds chunk r "
            "complete), every rank ends with every chunk complete, copied once around the ring "
            f"({p - 1} rounds, {p * (p - 1)} chunk transfers at p={p}): with the reduce-scatter, a "
            "ring all-reduce")


def allgather_problem(schedule: object, p: int) -> str | None:
    """What is wrong with ``schedule`` as the ring all-gather of ``p`` ranks, in the lesson's
    words."""
    if not isinstance(schedule, Schedule):
        return (f"ring_allgather returned {type(schedule).__name__}, not a Schedule: "
                "return Schedule(name, p, p, rounds)")
    if schedule.world_size != p:
        return (f"the schedule is for {schedule.world_size} ranks: "
                f"build it for the p = {p} it is asked for")
    if schedule.num_chunks != p:
        return (f"the schedule cuts the buffer into {schedule.num_chunks} chunks: the "
                f"reduce-scatter left {p}, one complete on each rank")
    start = ring.reduce_scatter(p)
    # holdings[rank, chunk, contributor], from the end of the reduce-scatter on
    history = simulate(concat("rs_then_yours", start, schedule)).holdings[len(start.rounds):]
    rounds = schedule.rounds
    for i, transfers in enumerate(rounds):
        before = history[i]
        for t in transfers:
            if t.op == "reduce":
                return (f"in round {i} rank {t.dst} adds chunk {t.chunk} from rank {t.src}: in the "
                        "all-gather every chunk sent is already complete, so the receiver copies "
                        "it ('copy'); adding would count every part twice")
            if t.dst != (t.src + 1) % p:
                return (f"in round {i} rank {t.src} sends to rank {t.dst}: in the ring each rank "
                        f"sends only to its right neighbour, (r + 1) mod p = {(t.src + 1) % p}, "
                        "and receives from its left")
            if not _complete(before[t.src, t.chunk]):
                return _early_send(schedule, history, i, t, p)
            if _complete(before[t.dst, t.chunk]):
                return (f"in round {i} rank {t.src} sends chunk {t.chunk} to rank {t.dst}, which "
                        "already holds it complete: a wasted send; each rank lacks p - 1 chunks, "
                        "so p - 1 rounds of one new chunk each are enough")
    end = history[-1]
    for rank in range(p):
        missing = [c for c in range(p) if not _complete(end[rank, c])]
        if missing:
            when = f"after the last round (round {len(rounds) - 1})" if rounds else "with no rounds"
            return (f"rank {rank} ends without chunk {missing[0]} complete {when}: it holds "
                    f"{p - len(missing)} of the {p} chunks. A rank lacks p - 1 chunks and receives "
                    f"one a round, so the all-gather takes p - 1 = {p - 1} rounds")
    if len(rounds) != p - 1:
        return (f"every rank ends with every chunk, but in {len(rounds)} rounds: the ring's "
                f"all-gather takes p - 1 = {p - 1}, every rank sending one chunk per round")
    for i, transfers in enumerate(rounds):
        sent = np.bincount([t.src for t in transfers], minlength=p)
        if (sent != 1).any():
            rank = int(np.flatnonzero(sent != 1)[0])
            return (f"in round {i} rank {rank} sends {int(sent[rank])} chunks: in the ring every "
                    "rank sends exactly one chunk per round, so every link is busy and none "
                    "carries more than its share")
    return None


def _complete(counts: np.ndarray) -> bool:
    return bool((counts == 1).all())


def _early_send(schedule: Schedule, history: list[np.ndarray], i: int, t, p: int) -> str:
    """A chunk sent before its sender holds it complete: say which rule was used instead."""
    held = [j for j in range(p) if history[i][t.src, t.chunk, j] == 1]
    text = (f"in round {i} rank {t.src} sends chunk {t.chunk}, which it does not hold complete (it "
            f"has {parts(held)} only), so rank {t.dst} is left with a partial chunk")
    if i == 0:
        if all(u.chunk == (u.src - 1) % p for u in schedule.rounds[0]):
            return (text + ": that is the reduce-scatter's rule, (r - k - 1) mod p; the "
                           "reduce-scatter left "
                    "rank r holding chunk r complete, so the all-gather starts one chunk later, "
                    "with chunk r")
        return text + (": in round 0 a rank sends the one chunk the reduce-scatter left complete "
                       f"on it, chunk {t.src}")
    got = [u for u in schedule.rounds[i - 1] if u.dst == t.src]
    if got:
        return (text + f": pass on what arrived in the round before (chunk {got[0].chunk}, from "
                       "rank "
                f"{got[0].src}); it is complete, and the right neighbour does not have it yet")
    return text
