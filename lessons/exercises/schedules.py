"""What the schedule exercises share: call the learner's schedule function in the child, bring the
schedules back as plain lists, and rebuild them here to be judged.

    inputs = {"function": "ring_allgather", "calls": [[1], [2], [3]]}  # ring_allgather(1), (2), (3)
    answer = run_learner("ring_allgather", file, inputs, output)
    schedule = rebuild(answer["data"]["schedules"][2])                  # a Schedule, or a stand-in

The ring all-gather (``ring_allgather.py``) and the tree broadcast (``tree.py``) use this; the
ring reduce-scatter (``ring.py``) uses ``plain`` and ``rebuild``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dplab.lessons.exercises.learner import Fail, learner_call, load_function, short_repr
from dplab.reference.schedule import Schedule, ScheduleError, Transfer

__all__ = ["MAX_TRANSFERS", "collect_schedules", "plain", "rebuild", "parts"]

MAX_TRANSFERS = 10_000  # per schedule: the exercises need at most p(p - 1) = 72 at p = 9


def collect_schedules(
    file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float
) -> None:
    """In the child: ``function(*args)`` for every call, as plain lists (``out["schedules"]``)."""
    name = inputs["function"]
    fn = load_function(file, name)
    out["schedules"] = schedules = []
    for args in inputs["calls"]:
        call = f"{name}({', '.join(map(str, args))})"
        with learner_call(file, call):
            schedule = fn(*args)
        schedules.append(plain(schedule, call, MAX_TRANSFERS, "far more than the exercise needs"))


def plain(schedule: object, call: str, limit: int, need: str) -> dict[str, Any]:
    """What the learner returned, as JSON: a Schedule's name, sizes and rounds of [src, dst, chunk,
    op], or the type and repr of anything else. More than ``limit`` transfers fails (``need``:
    why)."""
    if not isinstance(schedule, Schedule):
        return {"type": type(schedule).__name__, "repr": short_repr(schedule)}
    count = sum(map(len, schedule.rounds))
    if count > limit:
        raise Fail(f"{call} returned a schedule of {count:,} transfers: {need}")
    return {"type": "Schedule", "name": str(schedule.name)[:200], "world_size": schedule.world_size,
            "num_chunks": schedule.num_chunks,
            # numpy ints too
            "rounds": [[[int(t.src), int(t.dst), int(t.chunk), str(t.op)] for t in rnd]
                       for rnd in schedule.rounds]}


def rebuild(returned: dict[str, Any], said: str = "the schedule") -> object:
    """The learner's schedule rebuilt from its lists (and so checked again), or an empty object
    of the type's name they returned instead. ``said``: how a refusal names the schedule."""
    if returned["type"] != "Schedule":
        return type(returned["type"], (), {})()
    rounds = [tuple(Transfer(*t) for t in rnd) for rnd in returned["rounds"]]
    try:
        return Schedule(returned["name"], returned["world_size"], returned["num_chunks"], rounds)
    except ScheduleError as e:
        raise Fail(f"{said} cannot run: {e}") from None


def parts(ranks: list[int]) -> str:
    """``[1]`` -> "rank 1's part"; ``[0, 2]`` -> "ranks 0 and 2's parts"."""
    names = [str(r) for r in ranks]
    if len(names) == 1:
        return f"rank {names[0]}'s part"
    return f"ranks {', '.join(names[:-1])} and {names[-1]}'s parts"
