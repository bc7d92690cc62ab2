"""The synchronous recipe reads on its own: sync.py shows the five steps first, the hooks beside.

A learner opens ``reference/train/sync.py`` and must meet the recipe (broadcast, shard,
forward/backward, bucketed all-reduce, optimizer step) before anything else, in about forty
lines, with checkpoints, stragglers, the time budget, tracing and mixed precision each
attached as a hook (``reference/train/hooks.py``). The hooks must still do their jobs,
checked here in one run.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np

from dplab.backends.launch.world import launch
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.checkpoint.store import list_checkpoints
from dplab.reference.train import sync
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

EXTRAS = (
    "checkpoint",
    "save_state",
    "load_resume",
    "budget",
    "Budget",
    "Slowdown",
    "slow.",
    "tracer",
    "vote",
    "delays",
    "straggler",
    "Amp",
    "precision",
    "scaler",
)


def test_sync_py_opens_with_the_recipe_in_its_five_numbered_steps() -> None:
    tree = ast.parse(Path(sync.__file__).read_text())
    first = next(n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef))
    assert first.name == "train_sync", f"sync.py opens with {first.name}, not the recipe"
    source = inspect.getsource(train_sync)
    body = source.split('"""', 2)[2]  # after the docstring
    lines = [s for s in body.splitlines() if s.strip()]
    assert len(lines) <= 42, f"the recipe is {len(lines)} lines"  # 30, + 11 where hooks may attach
    marks = [int(m) for m in re.findall(r"# (\d)\. ", body)]
    assert marks == sorted(marks) and set(marks) == {1, 2, 3, 4, 5}, marks


def test_the_recipe_calls_the_hooks_and_holds_none_of_their_logic() -> None:
    body = inspect.getsource(train_sync).split('"""', 2)[2]
    code = "\n".join(line.split("#")[0] for line in body.splitlines())  # comments may name them
    leaked = [word for word in EXTRAS if word in code]
    assert not leaked, f"hooks' logic inside the recipe: {leaked}"


def _traced(comm, cfg: TrainConfig, sc: SyncConfig):
    comm.tracer.enabled = True
    return train_sync(comm, cfg, sc), comm.tracer.take()


def test_the_hooks_still_checkpoint_trace_straggle_and_resume(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=4)
    sc = SyncConfig(
        accum_steps=2, straggler=((1, 2.0),), checkpoint=CheckpointConfig(2, str(tmp_path))
    )
    (whole, events), (other, other_events) = launch(_traced, 2, args=(cfg, sc))
    assert [p.name for p in list_checkpoints(tmp_path).checkpoints] == ["ckpt-00000002.npz",
                                                                         "ckpt-00000004.npz"]
    kinds = [e.kind for e in events]
    for kind, per_step in (("forward", 2), ("backward", 2), ("wait", 1), ("optimizer", 1)):
        assert kinds.count(kind) == per_step * cfg.steps, kind
    assert "slowdown" in {e.kind for e in other_events} and "slowdown" not in kinds  # rank 1 only
    again = SyncConfig(
        accum_steps=2, checkpoint=CheckpointConfig(resume=str(tmp_path / "ckpt-00000002.npz"))
    )
    resumed = launch(train_sync, 2, args=(cfg, again))
    assert np.array_equal(resumed[0].params, whole.params) and resumed[0].losses == whole.losses
    assert np.array_equal(other.params, whole.params)  # replicas: bitwise identical


def test_a_time_budget_still_stops_every_rank_after_the_same_step() -> None:
    results = launch(train_sync, 3, args=(TrainConfig(steps=10**6), SyncConfig(time_budget_s=0.0)))
    assert [len(r.losses) for r in results] == [1, 1, 1]  # at least one step, then rank 0's vote
