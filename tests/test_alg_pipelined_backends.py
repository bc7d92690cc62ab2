"""The pipelined tree, the pipelined ring and the double tree on every installed backend (the
conformance suite's jobs, on persistent worlds), and data-parallel training with them equal to
one device within 1e-10 (float64)."""

from __future__ import annotations

import pytest
from test_collectives import assert_identical_everywhere, exact_sum, job_allreduce
from test_sync import _train, check_equals_single
from tiers import engines

from dplab.reference.model import MLPConfig
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig

NAMES = (
    "pipelined_tree",
    "pipelined_tree:1",
    "pipelined_tree:5",
    "pipelined_ring",
    "pipelined_ring:1",
    "pipelined_ring:3",
    "double_tree",
    "double_tree:1",
    "double_tree:3",
)


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 5, 8]), indirect=["backend"])
def test_exact_sum_on_every_rank(worlds, backend, p):
    for i, algorithm in enumerate(NAMES):
        for n, dtype, how in (
            (0, "int64", "shm"),
            (1, "float64", "numpy"),
            (2 * p + 1, "int32", "shm"),
            (10_007, "float32", "numpy"),
            (100_003, "int64", "shm"),
        ):
            results = worlds(p, backend).run(job_allreduce, algorithm, dtype, n, "sum", how, i + n)
            assert all(same for same, _, _ in results)
            assert_identical_everywhere([o for _, _, o in results], exact_sum(p, i + n, n, dtype),
                                        f"{algorithm} p={p} n={n} {dtype} {how}")


@pytest.mark.parametrize("algorithm", ["pipelined_tree:3", "pipelined_ring:2", "double_tree:2",
                                       "double_tree"])
@pytest.mark.parametrize("p", [3, 4])
def test_train_sync_equals_train_single(worlds, backend, p, algorithm):
    cfg = TrainConfig(
        model=MLPConfig(in_dim=5, hidden=(7,), out_dim=3),
        num_samples=64,
        global_batch=11,
        steps=3,
        seed=p,
    )
    for sync in (
        SyncConfig(algorithm, bucket_cap_mb=1e-6, accum_steps=1),
        SyncConfig(algorithm, 1e3, 2),
    ):
        check_equals_single(worlds(p, backend).run(_train, cfg, sync), cfg, 1e-10)
