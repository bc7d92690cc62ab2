"""``dplab compare`` runs its grid (``dplab.backends.runs.grid``): one World per backend and world
size, the single-device oracle once per training config, a progress bar on the terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import numpy as np

from dplab.backends.cli.table import Progress
from dplab.backends.launch.world import open_world
from dplab.backends.registry import entry
from dplab.backends.runs.run import RunSpec, run_train
from dplab.reference.train.single import train_single

__all__ = ["run_specs"]


def run_specs(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """Run every cell (validated first, so bad input fails before any work), one World per group."""
    for spec in specs:
        spec.validate()
    singles: dict[Any, np.ndarray] = {}  # the single-device oracle, once per training config
    rows, progress = [], Progress(len(specs))
    for (backend, p), group in groupby(specs, key=lambda s: (s.backend, s.world_size)):
        group = list(group)
        cluster = group[0].simulated_cluster() if entry(backend).simulated else None
        with open_world(p, backend, cluster=cluster) as world:  # under mpiexec/torchrun: its ranks
            for spec in group:
                single = None
                if spec.time_budget_s is None:
                    single = singles.get(spec.train)
                    if single is None:
                        single = singles[spec.train] = train_single(spec.train).params
                rows.append(run_train(spec, world, single=single)[0])
                progress.step(f"{backend} {spec.mode} {spec.label()} p={p}")
    progress.close()
    return rows
