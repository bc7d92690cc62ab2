"""The grids behind ``dplab compare`` and the app's Training page: an equivalence table, or a race
against the clock.

Without a time budget (the default for ``--modes sync``) every cell trains the same number of
steps and the table shows each all-reduce algorithm landing on the single-device parameters. With
a budget (the default once ``async`` is in ``--modes``) every cell trains for the same WALL TIME:

    sync      all-reduce data parallelism, one row per algorithm (default ring)
    backup    synchronous SGD through the parameter server, each step from the first
              W - b gradients (one row per ``--backup-workers``; with ``sync`` in a race)
    async     the parameter server with each staleness bound of ``--staleness-grid``

Throughput is ``samples_per_s``: samples whose gradients reached the parameters, per second (a
dropped backup gradient counts for nothing); quality is ``final_loss`` over the whole data set. A
parameter-server world of p ranks has p - 1 workers (rank 0 serves), an all-reduce world p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dplab.backends.runs.run import RunSpec

__all__ = ["compare_specs", "RACE_DEFAULTS", "EQUIVALENCE_DEFAULTS"]

RACE_DEFAULTS = {"time_budget_s": 3.0, "algorithms": ["ring"], "world_sizes": [4],
                 "staleness_grid": [0, 2, None], "backup_workers": [1]}
EQUIVALENCE_DEFAULTS = {"algorithms": ["naive", "ring", "tree", "native"],
                        "world_sizes": [1, 2, 3, 4]}


def compare_specs(base: RunSpec, backends: Sequence[str], world_sizes: Sequence[int],
                  modes: Sequence[str], algorithms: Sequence[str],
                  staleness_grid: Sequence[int | None],
                  backup_workers: Sequence[int]) -> list[RunSpec]:
    """The cells, grouped by backend and world size (one World each).

    ``sync``: one cell per all-reduce algorithm; ``async``: one per staleness bound;
    ``backup``: one per b, and in a race (``base.time_budget_s`` set) ``sync`` brings
    them too. Parameter-server cells that cannot exist in a world are left out: none in
    a world of 1 rank, no b >= workers (a default grid of 1..4 ranks stays valid).

    Args:
        base: the run every cell varies (its model, data, optimizer, steps, budget).
        backends: the backends of the grid.
        world_sizes: the world sizes of the grid.
        modes: ``"sync"``, ``"async"``, ``"backup"``: which kinds of cells to make.
        algorithms: the all-reduces of the sync cells.
        staleness_grid: the staleness bounds of the async cells (None: unbounded).
        backup_workers: the b of the backup cells.

    Returns:
        The cells, each a ``RunSpec``, backend by backend and world size by world size.
    """
    specs = []
    race = base.time_budget_s is not None
    for b in backends:
        for p in world_sizes:
            cell = replace(base, backend=b, world_size=p)
            if "sync" in modes:
                specs += [replace(cell, mode="sync", algorithm=alg) for alg in algorithms]
            if "backup" in modes or (race and "sync" in modes):
                specs += [replace(cell, mode="backup", backup_workers=k) for k in backup_workers
                          if k < p - 1]
            if "async" in modes and p >= 2:
                specs += [replace(cell, mode="async", staleness=s) for s in staleness_grid]
    return specs
