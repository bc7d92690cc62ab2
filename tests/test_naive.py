"""The plainest synchronous data parallelism equals one device, and the recipe with one bucket.

``train_naive`` (reference/train/naive.py) all-reduces the whole gradient after backward. Against
``train_single`` it must agree to rounding (float64: relative 1e-10) for any world size, batch
split (uneven, empty shards), algorithm and optimizer; its replicas must hold the same bits; and
``train_sync`` with every gradient in one bucket runs the same additions, so it lands on the same
bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from dplab.backends.launch.world import RankError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.naive import train_naive
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

CASES = [  # (world size, algorithm, TrainConfig)
    (1, "ring", TrainConfig(steps=4)),
    (2, "ring", TrainConfig(steps=6, optimizer=OptimConfig("adam"))),
    (3, "tree", TrainConfig(steps=5, global_batch=29, optimizer=OptimConfig("momentum"))),
    (4, "naive", TrainConfig(steps=5, model=MLPConfig(activation="relu", loss="xent"),
                             dataset="classification")),
    (4, "native", TrainConfig(steps=5, optimizer=OptimConfig("lamb"))),
    (5, "rabenseifner", TrainConfig(steps=4, global_batch=3)),  # two ranks hold no sample
]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _naive(comm, cfg: TrainConfig, algorithm: str):
    return train_naive(comm, cfg, algorithm)


def _one_bucket(comm, cfg: TrainConfig, algorithm: str):
    return train_sync(comm, cfg, SyncConfig(algorithm, bucket_cap_mb=1e3))


@pytest.mark.parametrize("p, algorithm, cfg", CASES)
def test_naive_equals_one_device_and_one_bucket(worlds, p, algorithm, cfg):
    naive = worlds(p).run(_naive, cfg, algorithm)
    single = train_single(cfg)
    assert all(r.params.tobytes() == naive[0].params.tobytes() for r in naive)  # replicas: bits
    assert _rel(naive[0].params, single.params) <= 1e-10
    assert _rel(np.array(naive[0].losses), np.array(single.losses)) <= 1e-10
    bucketed = worlds(p).run(_one_bucket, cfg, algorithm)[0]
    assert bucketed.params.tobytes() == naive[0].params.tobytes()  # the same additions
    np.testing.assert_allclose(bucketed.losses, naive[0].losses, rtol=1e-12)


def test_float32_stays_within_float32_rounding(worlds):
    cfg = TrainConfig(steps=5, dtype="float32")
    got = worlds(3).run(_naive, cfg, "ring")[0]
    assert got.params.dtype == np.float32
    assert _rel(got.params, train_single(cfg).params) <= 1e-5


def test_an_unknown_algorithm_is_named(worlds):
    with pytest.raises(RankError, match="'rng'"):
        worlds(2).run(_naive, TrainConfig(steps=1), "rng")
