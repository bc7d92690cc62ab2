"""Checkpoint and resume for the data-parallel trainers: stop anywhere, go on bit for bit.

    from dplab.reference.checkpoint.resume import CheckpointConfig
    ckpt = CheckpointConfig(every=2, directory="ckpts")            # write every 2 steps
    launch(train_sync, 4, args=(cfg, SyncConfig(checkpoint=ckpt)))
    again = CheckpointConfig(every=2, directory="ckpts", resume="ckpts")   # after a crash

Storage is ``dplab.reference.checkpoint.store`` (atomic, checksummed, no pickle); this file decides
WHAT a trainer saves and how it picks up again.

Synchronous (``dplab.reference.train.sync``): every replica is identical, so rank 0 alone writes,
after step t: the parameters, the optimizer state, the data position (steps done, and
the losses so far so that the resumed run reports the whole run) and the step. On
resume EVERY rank loads the same file, so all replicas start equal again. There is no
RNG state to keep: the batch of step t is a pure function of (seed, t), and that is
what makes the resumed run's final parameters equal an uninterrupted run's EXACTLY.

Asynchronous (``dplab.reference.ps.server``): the server writes, every ``every`` updates, its
parameters, optimizer state, version, each worker's finished clocks, the log so far and
the dropped pushes. On resume it restores them and hands each worker, whatever clock it
asks for, its next unfinished clock; gradients that were in flight at the crash are
simply computed again. An asynchronous run is not reproducible by re-running it (the
interleaving depends on timing), so "exactly" means what it means for any async run:
the COMBINED log (the checkpoint's prefix, then what the resumed run appended) replays
on one device to the final parameters, bit for bit (``dplab.reference.ps.replay``).

A checkpoint records the run's configuration (``run_meta``): resuming under another
one (other model, seed, learning rate, world size, algorithm, staleness ...) is refused
naming the field. Steps, clocks, stragglers, delays and time budgets are left out: they
change how far or how fast a run goes, not the arithmetic of a step, so a run may be
resumed to train longer. A time budget starts afresh in the resumed run (wall time spent
before the crash is not carried over).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dplab.reference.checkpoint.store import Checkpoint, load_checkpoint, save_checkpoint
from dplab.reference.errors import ConfigError
from dplab.reference.train.single import TrainConfig

__all__ = ["CheckpointConfig", "run_meta", "load_resume", "save_state"]

_SPEED_FIELDS = ("straggler", "delays", "time_budget_s", "max_delay_s", "delay_seed", "clocks",
                 "kill_at", "checkpoint")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint, and where to resume from (None: start afresh)."""

    every: int = 0  # steps (sync) or server updates (async) between checkpoints; 0: never
    directory: str | None = None  # where checkpoints go
    resume: str | None = None  # a checkpoint file, or a directory: its latest checkpoint
    keep_last: int | None = None  # delete all but the last k checkpoints; None keeps all

    def validate(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"checkpoint every must be an integer >= 0 (0: never), got {self.every!r}")
        if self.every and not self.directory:
            raise ConfigError("checkpoint every > 0 needs a checkpoint directory (--checkpoint-dir)")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {self.keep_last}")

    def due(self, step: int) -> bool:
        """Checkpoint after ``step`` steps (or updates) are done?"""
        return bool(self.every) and step > 0 and step % self.every == 0


def run_meta(mode: str, cfg: TrainConfig, mode_cfg: Any, world_size: int) -> dict:
    """What a checkpoint must agree on with the run resuming from it: the arithmetic, not the pace."""
    train = dataclasses.asdict(dataclasses.replace(cfg, steps=0))
    train.pop("steps")
    rules = {k: v for k, v in dataclasses.asdict(mode_cfg).items() if k not in _SPEED_FIELDS}
    return {"mode": mode, "world_size": world_size, "train": train, mode: rules}


def load_resume(ckpt: CheckpointConfig | None, meta: dict) -> Checkpoint | None:
    """The checkpoint to resume from, verified and of this configuration, or None to start afresh."""
    if ckpt is None or ckpt.resume is None:
        return None
    return load_checkpoint(ckpt.resume, expect_meta=meta)


def save_state(ckpt: CheckpointConfig, step: int, params: Any, opt_state: dict,
               position: dict, meta: dict) -> None:
    """One checkpoint; no RNG state: every random choice is a pure function of seeds and clocks."""
    assert ckpt.directory is not None  # validate() guarantees it when every > 0
    save_checkpoint(ckpt.directory, step, params, opt_state, position, None, meta,
                    keep_last=ckpt.keep_last)
