"""Bytes each rank sends per ZeRO step: counted from the trace, and the closed forms they meet.

    comm.tracer.enabled = True
    train_zero(comm, cfg, ZeroConfig(stage=3))
    sent_per_step(comm.tracer.take(), comm.rank)     # [bytes of step 0, step 1, ...], this rank
    sent_closed_form(3, num_params, p) * itemsize    # their mean over the ranks, exactly

Per step and rank, Psi parameters, ``accum_steps`` = a micro-batches (stage 3 gathers layer 0
for backward too, as the paper counts and FSDP does):

    stage 0   all-reduce of the gradient (once, after the last micro-batch)     2 (p-1)/p Psi
    stage 1   reduce-scatter of the gradient + all-gather of the new weights    2 (p-1)/p Psi
    stage 2   a reduce-scatter per micro-batch + the all-gather            (a + 1) (p-1)/p Psi
    stage 3   per micro-batch: gather for forward, again for backward,
              reduce-scatter of the gradient                                  3a (p-1)/p Psi

Ranks differ from the mean when chunks are uneven; ``collective_sent`` gives one rank's count.
"""

from __future__ import annotations

from collections.abc import Iterable

from dplab.reference.collectives import schedule_plan
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.trace import Event

__all__ = ["sent_per_step", "sent_closed_form", "collective_sent"]


def sent_per_step(events: Iterable[Event], rank: int) -> list[int]:
    """Bytes ``rank`` sent inside each ``zero_step`` span (the loss all-reduce comes after it).

    Args:
        events: a run's trace events.
        rank: the rank.

    Returns:
        Bytes per step, in step order.
    """
    events = [e for e in events if e.rank == rank]
    steps = sorted((e for e in events if e.kind == "zero_step"), key=lambda e: e.extra["step"])
    sends = [e for e in events if e.kind == "send"]
    return [
        sum(e.bytes for e in sends if s.t_start_ns <= e.t_start_ns <= s.t_end_ns) for s in steps
    ]


def sent_closed_form(stage: int, num_params: float, world_size: int, accum_steps: int = 1) -> float:
    """Elements one rank sends per step, averaged over the ranks (multiply by the itemsize for
    bytes).

    Args:
        stage: the ZeRO stage.
        num_params: the model's parameter count.
        world_size: the number of ranks.
        accum_steps: micro-batches per step.

    Returns:
        Elements per rank and step.

    Raises:
        ConfigError: a bad stage.
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    times = {0: 2, 1: 2, 2: accum_steps + 1, 3: 3 * accum_steps}[stage]
    return times * (world_size - 1) / world_size * num_params


def collective_sent(kind: str, algorithm: str, world_size: int, rank: int, n: int) -> int:
    """Elements ``rank`` sends in one ``kind`` (allreduce, reduce_scatter, allgather) of ``n``
    elements, read off the schedule the executor runs.

    Args:
        kind: the collective.
        algorithm: its algorithm.
        world_size: the number of ranks.
        rank: the rank.
        n: elements in the buffer.

    Returns:
        Elements ``rank`` sends.
    """
    schedule, plan = schedule_plan(kind, algorithm, world_size, rank)
    bounds = chunk_bounds(n, schedule.num_chunks)
    # messages
    return sum(bounds[m.stop - 1][1] - bounds[m.chunk][0] for sends, _ in plan for m in sends)
