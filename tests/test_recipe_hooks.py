"""The recipe apart from the run: with no hook attached ``train_sync`` is its five steps, bit for
bit.

A hook that does nothing, or hooks that change only when things happen (trace spans, a straggler
at factor 1 with no delay, a budget that never runs out, checkpoints), leave every parameter and
every loss the same bits as the bare recipe; against one device the run agrees to rounding. And
with no hook the recipe calls every hook point on ``Hooks([])``, which does nothing: no hook's
code runs on the default path.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.launch.world import launch
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.hooks import Hook, Hooks, Run
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.train.sync import SyncConfig, train_sync

CFG = TrainConfig(steps=4, global_batch=29, optimizer=OptimConfig("adam"))
# several buckets, a no_sync micro-batch
SYNC = SyncConfig("tree", bucket_cap_mb=0.0005, accum_steps=2)


class Nothing(Hook):
    """Every point of the hook protocol, each changing nothing (the composite's paths all run)."""


class Recorder(Hook):
    """Counts where it was called, and hands every layer on untouched."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_start(self, run: Run) -> None:
        self.calls.append("start")

    @contextmanager
    def forward(self, step: int, micro: int):
        self.calls.append("forward")
        yield

    def backward(self, step: int, micro: int, layers):
        for layer in layers:
            self.calls.append(f"layer {layer}")
            yield layer

    def after_step(self, run: Run, step: int) -> None:
        self.calls.append("after")


def _run(comm, cfg: TrainConfig, sync: SyncConfig, hooks: list[Hook], trace: bool):
    comm.tracer.enabled = trace
    result = train_sync(comm, cfg, sync, hooks)
    comm.tracer.enabled = False
    return result, comm.tracer.take(), [h.calls for h in hooks if isinstance(h, Recorder)]


def _same_bits(a, b) -> None:
    for (ra, _, _), (rb, _, _) in zip(a, b, strict=True):
        assert ra.params.dtype == rb.params.dtype and np.array_equal(ra.params, rb.params)
        assert ra.losses == rb.losses  # floats compared exactly


def test_no_hooks_is_bitwise_the_recipe_and_hooks_that_change_nothing_change_no_bit(
    tmp_path: Path,
) -> None:
    bare = launch(_run, 3, args=(CFG, SYNC, [], False))
    for (r, events, _) in bare:  # replicas: the same bits; one device: within rounding
        assert np.array_equal(r.params, bare[0][0].params) and events == []
        single = train_single(CFG)
        assert np.max(np.abs(r.params - single.params)) <= 1e-10 * np.max(np.abs(single.params))
        np.testing.assert_allclose(r.losses, single.losses, rtol=1e-10)
    _same_bits(bare, launch(_run, 3, args=(CFG, SYNC, [Nothing()], False)))
    recorded = launch(_run, 3, args=(CFG, SYNC, [Recorder(), Nothing()], False))
    _same_bits(bare, recorded)
    calls = recorded[0][2][0]
    layers = [f"layer {i}" for i in reversed(range(MLP(CFG.model).num_layers))]
    per_step = [*(["forward", *layers] * SYNC.accum_steps), "after"]
    assert calls == ["start", *per_step * CFG.steps]
    timing_only = SyncConfig(
        SYNC.algorithm,
        SYNC.bucket_cap_mb,
        SYNC.accum_steps,
        straggler=((1, 2.0),),
        delays=(0.0, 0.001, 0.0),
        time_budget_s=1e9,
        checkpoint=CheckpointConfig(2, str(tmp_path)),
    )
    traced = launch(_run, 3, args=(CFG, timing_only, [], True))
    _same_bits(bare, traced)
    assert {e.kind for e in traced[0][1]} >= {"forward", "backward", "wait", "optimizer"}
    # rank 1 straggled, and computed the same bits
    assert "slowdown" in {e.kind for e in traced[1][1]}
    resumed = SyncConfig(SYNC.algorithm, SYNC.bucket_cap_mb, SYNC.accum_steps,
                         checkpoint=CheckpointConfig(resume=str(tmp_path / "ckpt-00000002.npz")))
    _same_bits(bare, launch(_run, 3, args=(CFG, resumed, [], False)))


def test_the_default_path_runs_no_hook_code() -> None:
    """A tracer over one rank of the default run: no function of a hook's file is called, and in
    hooks.py only the empty composite's (the recipe calls every point on ``Hooks([])``)."""
    hook_files = ("hooks.py", "spans.py", "checkpoints.py", "straggler.py", "amp.py", "scaler.py",
                  "resume.py")
    composite = [getattr(f, "__wrapped__", f).__code__ for f in vars(Hooks).values() if callable(f)]
    for code in composite:  # and the comprehensions inside them
        composite += [c for c in code.co_consts if isinstance(c, type(code))]

    def one_rank(comm):
        called: set[str] = set()

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code not in composite:
                called.add(Path(frame.f_code.co_filename).name)

        sys.settrace(tracer)
        try:
            train_sync(comm, TrainConfig(steps=2))
        finally:
            sys.settrace(None)
        return called

    called = launch(one_rank, 2)[0]
    assert "sync.py" in called and "model.py" in called
    assert not called & set(hook_files), called & set(hook_files)


def test_a_hook_stops_every_rank_on_the_loss_allreduce_and_layers_come_from_the_model() -> None:
    class StopAtTwo(Hook):
        def wants_to_stop(self, step: int) -> bool:
            return step == 2

    def rank(comm):  # only rank 1 asks: every rank still stops after the same step
        return train_sync(
            comm, TrainConfig(steps=10), SyncConfig(), [StopAtTwo()] if comm.rank == 1 else []
        )

    assert [len(r.losses) for r in launch(rank, 3)] == [3, 3, 3]
    model = MLP(MLPConfig(in_dim=3, hidden=(5, 4), out_dim=2))
    assert [model.layer_params(layer) for layer in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert [model.param_names[i] for i in model.layer_params(1)] == ["W1", "b1"]
    with pytest.raises(ConfigError, match="layer must be in 0..2"):
        model.layer_params(3)
    assert not Hooks([]) and Hooks([Nothing()])
