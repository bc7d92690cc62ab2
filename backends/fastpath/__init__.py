"""The engine's fast paths over the spine's schedules, each proven bitwise equal to the spine.

    executor.py      the collectives with per-call plans compiled once and snapshot scratch reused
                     (``dplab.reference.collectives`` is the readable executor it must equal:
                     ``tests/test_spine_equals_engine.py``)
    arrays.py        the schedules that grow like p^2 built as arrays, to price p = 4096 (the
                     readable builders of ``dplab.reference.algorithms`` are the source they
                     must equal)

Used where per-call overhead shows: ``dplab bench``, DDP's buckets, the torch wrappers.
"""

from dplab.backends.fastpath.executor import allgather, allreduce, broadcast, reduce, reduce_scatter

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"]
