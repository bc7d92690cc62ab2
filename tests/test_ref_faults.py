"""A worker killed during asynchronous training: the error names the worker that died.

On the local backend the server notices and goes on (``tests/test_faults.py``). On mpi
(MPI ends the job when a rank dies) and torch (gloo cannot tell a dead peer from a slow
one) the run cannot go on, so it must stop at once with an error naming the dead rank,
not rank 0 ("lost any rank"), not a survivor's timeout a minute later, not MPICH's stack.
"""

from __future__ import annotations

import time

import pytest

from dplab.backends.launch.world import (
    BackendUnavailable,
    RankError,
    RankLost,
    check_backend,
    launch,
)
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.train.single import TrainConfig

WORKERS = frozenset({1, 2})  # tolerated, as ``dplab train --mode async`` asks


@pytest.mark.parametrize("backend", [pytest.param("mpi", marks=pytest.mark.mpi),
                                     pytest.param("torch", marks=pytest.mark.torch)])
def test_a_killed_worker_is_named_on_mpi_and_torch(backend: str) -> None:
    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    acfg = AsyncConfig(staleness=1, kill_at=(2, 3))
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(
            train_async,
            3,
            backend,
            args=(TrainConfig(steps=10), acfg),
            tolerate=WORKERS,
            timeout=120,
        )
    assert time.monotonic() - t0 < 60  # at once, not after a survivor's 120 s timeout
    assert info.value.rank == 2, str(info.value)
    assert str(info.value).startswith("rank 2 failed:") and "died" in str(info.value)


def test_on_local_the_same_kill_is_survived() -> None:
    acfg = AsyncConfig(staleness=1, kill_at=(2, 3))
    results = launch(train_async, 3, "local", args=(TrainConfig(steps=10), acfg), tolerate=WORKERS)
    assert isinstance(results[2], RankLost) and results[0].lost == [(2, 3)]
