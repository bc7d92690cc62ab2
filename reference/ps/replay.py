"""Replay a parameter server's log on one device: the proof that the log tells the whole story.

Every gradient is a pure function of (parameter version, worker, clock), so replaying the
applied updates in log order, each recomputed at its version with the same functions as the
server and workers (``worker_batch``, ``compute_gradient``, ``combine``, the optimizer's ``step``),
gives the same bits. Dropped backup gradients changed nothing; under a budget the log ends
where the server stopped.

    >>> from dplab.reference.ps.replay import replay
    >>> np.array_equal(replay(cfg, acfg, result.log), result.params)   # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby

import numpy as np

from dplab.reference.errors import ConfigError
from dplab.reference.optim import make_optimizer
from dplab.reference.ps.trainer import (
    AsyncConfig,
    LogEntry,
    compute_gradient,
    update_gradient,
    worker_batch,
)
from dplab.reference.train.single import TrainConfig, setup

__all__ = ["replay"]


def replay(
    cfg: TrainConfig,
    acfg: AsyncConfig,
    log: list[LogEntry],
    workers: int | None = None,
    fresh: bool = False,
    each: Callable[[int, np.ndarray], None] | None = None,
) -> np.ndarray:
    """The server's final parameters, recomputed from its log;
    ``workers`` defaults to the largest in it.

    ``fresh=True`` computes every gradient on the parameters current at its update instead of the
    version it was computed on: the same batches in the same order without the staleness (what the
    run would have been had every gradient been up to date). ``each(produced, params)`` is called
    after every update (params: the live array; copy what you keep).

    Args:
        cfg: the run's configuration.
        acfg: the server's configuration.
        log: the server's log, in order.
        workers: the number of workers.
        fresh: compute each gradient on the current parameters instead of its version.
        each: called after every update, or None.

    Returns:
        The final parameters: bitwise the server's when ``fresh`` is False.

    Raises:
        ConfigError: an invalid ``acfg``; backup workers without ``workers``; a log out of order,
            with an update of the wrong number of gradients, or with an impossible entry.
    """
    acfg.validate()
    if workers is None and acfg.backup_workers:
        raise ConfigError("with backup workers a worker may be missing from the log: pass workers=")
    model, data, params = setup(cfg)
    workers = workers if workers is not None else max((e.worker for e in log), default=1)
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype, model.param_slices)
    # the update after which version v is not needed
    last_use = {e.version: e.produced for e in log}
    versions = {0: params.copy()}  # versions[v]: the parameters after v updates, while still needed
    expected = 1
    for produced, group in groupby(log, key=lambda e: e.produced):
        entries = list(group)
        check_update(entries, produced, expected, workers, acfg)
        grads = []
        for e in entries:
            grad = np.empty_like(params)
            idx = worker_batch(cfg, e.worker, workers, e.clock)
            compute_gradient(model, data, cfg, params if fresh else versions[e.version], idx, grad)
            grads.append(grad)
        pushes = [(e.worker, e.clock) for e in entries]
        opt.step(params, update_gradient(cfg, acfg, workers, pushes, grads))
        for v in [v for v in versions if last_use.get(v, 0) <= produced]:
            del versions[v]  # long runs (a time budget) keep only the versions still to be read
        if produced in last_use:
            versions[produced] = params.copy()
        if each is not None:
            each(produced, params)
        expected += 1
    return params


def check_update(entries: list[LogEntry], produced: int, expected: int, workers: int,
                 acfg: AsyncConfig) -> None:
    """A log that cannot come from the server is a ConfigError, not a silently different answer."""
    if produced != expected:
        raise ConfigError(f"log entry produces version {produced} but {expected} comes next: pass "
                          "the server's log unchanged, in order")
    needed = workers - acfg.backup_workers if acfg.aggregate else 1
    if len(entries) != needed:
        raise ConfigError(f"version {produced} was produced by {len(entries)} gradients: aggregate="
                          f"{acfg.aggregate}, backup_workers={acfg.backup_workers} needs {needed} "
                          "(pass the run's AsyncConfig and workers)")
    for e in entries:
        if not 0 <= e.version < produced or not 1 <= e.worker <= workers:
            raise ConfigError(f"log entry {e} computed on a version it could not have seen, or by "
                              f"a worker outside 1..{workers}")
