"""The recipe's results, pinned to the bit: every rank's final parameters and losses, as recorded.

``tests/golden/train_sync.json`` holds a SHA-256 of the final parameters and losses of
``train_sync`` for a few configurations (algorithms, buckets, micro-batches, uneven and empty
shards, optimizers, float32, mixed precision, the hooks that change only when things happen, a
user's hook, torch tensors), on the kernels tests/kernels.py pins. They were recorded before the
recipe was rewritten as a straight loop (issue 29), so a rewrite that changes the order of one
addition fails here, however small the difference. A change that must move the bits (a new model
initialisation, say) records them again:

    python tests/test_recipe_golden.py --record      # then say why in the commit
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import kernels
import numpy as np
import pytest

from dplab.backends.launch.world import World
from dplab.reference.checkpoint.resume import CheckpointConfig
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.precision.config import MixedPrecision
from dplab.reference.train.hooks import Hook
from dplab.reference.train.single import TrainConfig
from dplab.reference.train.sync import SyncConfig, train_sync

GOLDEN = Path(__file__).with_name("golden") / "train_sync.json"
XENT = MLPConfig(activation="relu", loss="xent")

# name: (world size, TrainConfig, SyncConfig, attach a user's hook that changes nothing)
CASES: dict[str, tuple[int, TrainConfig, SyncConfig, bool]] = {
    "ring-defaults-p4": (4, TrainConfig(steps=6), SyncConfig("ring"), False),
    "tree-buckets-accum-adam-p3": (
        3, TrainConfig(steps=5, global_batch=29, optimizer=OptimConfig("adam")),
        SyncConfig("tree", bucket_cap_mb=0.0005, accum_steps=2), False),
    "native-xent-momentum-p4": (
        4, TrainConfig(steps=5, model=XENT, dataset="classification",
                       optimizer=OptimConfig("momentum", weight_decay=0.01)),
        SyncConfig("native", bucket_cap_mb=1e-3, accum_steps=3), False),
    "direct-float32-lamb-p2": (
        2, TrainConfig(steps=5, dtype="float32", optimizer=OptimConfig("lamb")),
        SyncConfig("direct", bucket_cap_mb=1e-6), False),
    "rabenseifner-empty-shards-p5": (
        5, TrainConfig(steps=4, global_batch=3),
        SyncConfig("rabenseifner", bucket_cap_mb=2e-4, accum_steps=4), False),
    "naive-warmup-lars-p3": (
        3, TrainConfig(steps=5, optimizer=OptimConfig("lars", lr=5.0, warmup_steps=3)),
        SyncConfig("naive"), False),
    "mixed-precision-adam-p3": (
        3, TrainConfig(steps=5, dtype="float32", optimizer=OptimConfig("adam")),
        SyncConfig("ring", bucket_cap_mb=0.0005, precision=MixedPrecision()), False),
    "timing-hooks-and-a-users-hook-p3": (
        3, TrainConfig(steps=5, global_batch=29),
        SyncConfig("tree", bucket_cap_mb=0.0005, accum_steps=2, straggler=((1, 1.5),),
                   delays=(0.0, 0.0, 0.001), time_budget_s=1e9), True),
}
CHECKPOINTED = "tree-buckets-accum-adam-p3"  # again with checkpoints every 2 steps: the same bits
TORCH = "ring-defaults-p4"  # run again on torch tensors (the cuda backend's ranks on the CPU)


class Nothing(Hook):
    """A user's hook at every point, changing nothing."""


def _rank(comm, cfg: TrainConfig, sync: SyncConfig, user_hook: bool,
          on_torch: bool) -> tuple[bytes, list]:
    device = None
    if on_torch:
        import torch

        device = torch.device("cpu")
    result = train_sync(comm, cfg, sync, [Nothing()] if user_hook else [], device=device)
    return result.params.tobytes() + str(result.params.dtype).encode(), result.losses


def fingerprint(results: list[tuple[bytes, list]]) -> str:
    """One hash of rank 0's parameters (bytes and dtype) and losses (exactly), after checking that
    every rank holds the same bits."""
    params, losses = results[0]
    assert all(r == results[0] for r in results), "the replicas differ"
    return hashlib.sha256(params + np.array(losses, dtype=np.float64).tobytes()).hexdigest()


def _moved(name: str) -> str:
    """What a mismatch says: the code, or the kernels it ran on."""
    pinned = {k: os.environ.get(k) for k in kernels.KERNELS}
    return (f"{name}: the bits moved; if no change to the code explains it, the kernels may: "
            f"this run had {pinned} (tests/kernels.py pins them)")


def _run(name: str, checkpoint_dir: str | None = None, on_torch: bool = False) -> str:
    p, cfg, sync, user_hook = CASES[name]
    if checkpoint_dir is not None:
        sync = dataclasses.replace(sync, checkpoint=CheckpointConfig(2, checkpoint_dir))
    with World(p, "cuda" if on_torch else "local", timeout=60) as world:
        return fingerprint(world.run(_rank, cfg, sync, user_hook, on_torch))


def _cuda_on_cpu(monkeypatch: Any) -> None:
    """The cuda backend's ranks on the CPU (threads, torch tensors), as test_torch_recipe.py has."""
    from dplab.backends import registry
    from dplab.backends.cuda import setup as cuda_setup

    cpu = sys.modules["torch"].device("cpu")
    monkeypatch.setitem(registry.BACKENDS, "cuda",
                        dataclasses.replace(registry.BACKENDS["cuda"], available=lambda: None))
    monkeypatch.setattr(cuda_setup, "_DEVICE_OF", lambda rank: cpu)


@pytest.mark.parametrize("name", CASES)
def test_the_recipe_gives_the_recorded_bits(name: str) -> None:
    assert _run(name) == json.loads(GOLDEN.read_text())[name], _moved(name)


def test_checkpoints_change_no_bit(tmp_path: Path) -> None:
    got = _run(CHECKPOINTED, str(tmp_path))
    assert got == json.loads(GOLDEN.read_text())[CHECKPOINTED], _moved(CHECKPOINTED)


@pytest.mark.torch
def test_torch_tensors_give_the_recorded_bits(monkeypatch: Any) -> None:
    pytest.importorskip("torch")
    _cuda_on_cpu(monkeypatch)
    assert _run(TORCH, on_torch=True) == json.loads(GOLDEN.read_text())[f"{TORCH}-torch"]


def record() -> None:
    """Write every case's fingerprint to ``GOLDEN`` (the torch case too, where torch is installed).

    Returns:
        None; prints where it wrote."""
    golden = {name: _run(name) for name in CASES}
    try:
        pytest.importorskip("torch")
    except pytest.skip.Exception:
        print("torch is not installed: the torch case is not recorded", file=sys.stderr)
    else:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _cuda_on_cpu(monkeypatch)
            golden[f"{TORCH}-torch"] = _run(TORCH, on_torch=True)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{GOLDEN}: {len(golden)} fingerprints")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_recipe_golden.py --record")
    if kernels.has_avx2() and any(os.environ.get(k) != v for k, v in kernels.KERNELS.items()):
        # NumPy is loaded, its kernels chosen: record in a process started with the pin
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **kernels.KERNELS})
    record()
