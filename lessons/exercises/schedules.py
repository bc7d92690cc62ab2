"""What the schedule exercises share: call the learner's schedule function in the child, bring the
schedules back as plain columns, and rebuild them here to be judged.

    inputs = {"function": "ring_allgather", "calls": [[1], [2], [3]]}   # ring_allgather(1), (2), (3)
    answer = run_learner("ring_allgather", file, inputs, output)
    schedule = rebuild(answer["data"]["schedules"][2])                  # a Schedule, or a stand-in

The ring all-gather (``ring_allgather.py``) and the tree broadcast (``tree.py``) use this; the
ring reduce-scatter keeps its own (``ring.py``), older and the same in spirit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dplab.lessons.exercises.learner import Fail, learner_call, load_function, short_repr
from dplab.reference.schedule import Round, Schedule, ScheduleError

__all__ = ["MAX_TRANSFERS", "collect_schedules", "rebuild", "parts"]

MAX_TRANSFERS = 10_000  # per schedule: the exercises need at most p(p - 1) = 72 at p = 9


def collect_schedules(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: ``function(*args)`` for every call, as plain columns (``out["schedules"]``)."""
    name = inputs["function"]
    fn = load_function(file, name)
    out["schedules"] = schedules = []
    for args in inputs["calls"]:
        call = f"{name}({', '.join(map(str, args))})"
        with learner_call(file, call):
            schedule = fn(*args)
        if not isinstance(schedule, Schedule):
            schedules.append({"type": type(schedule).__name__, "repr": short_repr(schedule)})
            continue
        t = schedule.table
        if t.num_transfers > MAX_TRANSFERS:
            raise Fail(f"{call} returned a schedule of {t.num_transfers:,} transfers: far more than the "
                       "exercise needs")
        schedules.append({"type": "Schedule", "name": str(schedule.name)[:200],
                          "world_size": schedule.world_size, "num_chunks": schedule.num_chunks,
                          "src": t.src.tolist(), "dst": t.dst.tolist(), "chunk": t.chunk.tolist(),
                          "reduce": t.reduce.tolist(), "starts": t.starts.tolist()})


def rebuild(plain: dict[str, Any]) -> object:
    """The learner's schedule rebuilt from its columns (and so checked again), or an empty object
    of the type's name they returned instead."""
    if plain["type"] != "Schedule":
        return type(plain["type"], (), {})()
    starts = plain["starts"]
    cols = [np.asarray(plain[k], np.int64) for k in ("src", "dst", "chunk")]
    ops = np.where(np.asarray(plain["reduce"], bool), "reduce", "copy")
    try:
        rounds = [Round(*(c[a:b] for c in cols), ops[a:b]) for a, b in zip(starts, starts[1:])]
        return Schedule(plain["name"], plain["world_size"], plain["num_chunks"], rounds)
    except ScheduleError as e:
        raise Fail(f"the schedule cannot run: {e}") from None


def parts(ranks: list[int]) -> str:
    """``[1]`` -> "rank 1's part"; ``[0, 2]`` -> "ranks 0 and 2's parts"."""
    names = [str(r) for r in ranks]
    if len(names) == 1:
        return f"rank {names[0]}'s part"
    return f"ranks {', '.join(names[:-1])} and {names[-1]}'s parts"
