"""An overflow under dynamic loss scaling is expected and handled (the step is skipped): the run
says so in its trace, not in a wall of numpy RuntimeWarnings from every rank."""

from __future__ import annotations

import warnings

from dplab.backends import launch
from dplab.backends.runs.run import RunSpec, train_rank
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.train.single import TrainConfig


def rank_warnings(comm, spec):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, _, events = train_rank(comm, spec, True)
    skips = sum(e.kind == "loss_scale" and e.extra["action"] == "skip" for e in events)
    return skips, [str(w.message) for w in caught]


def test_float16_overflows_skip_steps_without_numpy_warnings():
    spec = RunSpec(world_size=2, train=TrainConfig(steps=4, dtype="float32"),
                   precision=MixedPrecision(init_scale=2.0**24))
    for skips, caught in launch(rank_warnings, 2, args=(spec,)):
        assert skips > 0, "the scale 2**24 must overflow float16 and skip steps"
        assert caught == []
