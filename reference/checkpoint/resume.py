"""Checkpoint and resume for the data-parallel trainers: what a trainer saves, and what must agree.

    from dplab.reference.checkpoint.resume import CheckpointConfig
    ckpt = CheckpointConfig(every=2, directory="ckpts")            # write every 2 steps
    launch(train_sync, 4, args=(cfg, SyncConfig(checkpoint=ckpt)))
    again = CheckpointConfig(every=2, directory="ckpts", resume="ckpts")   # after a crash

Storage is ``store.py``. Sync: rank 0 saves parameters, optimizer state, data position and step;
every rank loads the same file, and the resumed run equals the uninterrupted one bitwise.
Async (``dplab.reference.ps.snapshot``): the server saves its state, clocks and log; the combined
log replays bit for bit. Contract (``Expect``): a resumed run must share the arithmetic (model,
data, seed, optimizer, dtype, staleness ...), the backend, world size and algorithm, and may only
train longer; a file must agree with itself. Anything else is refused in one line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.reference.checkpoint.store import (
    Bounds,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP
from dplab.reference.optim import make_optimizer
from dplab.reference.train.single import TrainConfig

__all__ = ["CheckpointConfig", "Expect", "run_meta", "load_resume", "save_state"]

# A manifest's bytes (json.dumps(indent=1)): a loss is one float on its line (at most ~30 bytes), a
# server update one log entry of five integers and perhaps one dropped push (~150 bytes in all).
_LOSS_BYTES, _LOG_BYTES = 64, 256
_MANIFEST_BASE = 1 << 16  # the manifest's own keys, the optimizer's scalars, the loss scale
_MANIFEST_MAX = 1 << 30  # a manifest beyond 1 GiB is not one dplab writes, whatever --steps says
_SPEED_FIELDS = ("straggler", "delays", "time_budget_s", "max_delay_s", "delay_seed", "clocks",
                 "kill_at", "checkpoint")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint, and where to resume from (None: start afresh).

    Args:
        every: steps (sync) or server updates (async) between checkpoints; 0: never.
        directory: where checkpoints go.
        resume: a checkpoint file, or a directory (its latest), to resume from.
        keep_last: how many to keep, or None for all.
    """

    every: int = 0  # steps (sync) or server updates (async) between checkpoints; 0: never
    directory: str | None = None  # where checkpoints go
    resume: str | None = None  # a checkpoint file, or a directory: its latest checkpoint
    keep_last: int | None = None  # delete all but the last k checkpoints; None keeps all

    def validate(self) -> None:
        """Refuse settings that cannot work, naming the flag to change.

        Raises:
            ConfigError: a negative ``every``, ``every`` without a directory, or ``keep_last`` < 1.
        """
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError("checkpoint every must be an integer >= 0 (0: never), got "
                              f"{self.every!r}")
        if self.every and not self.directory:
            raise ConfigError(
                "checkpoint every > 0 needs a checkpoint directory (--checkpoint-dir)"
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {self.keep_last}")

    def due(self, step: int) -> bool:
        """Checkpoint after ``step`` steps (or updates) are done?

        Args:
            step: steps (or server updates) done.

        Returns:
            True when a checkpoint is due.
        """
        return bool(self.every) and step > 0 and step % self.every == 0


def run_meta(
    mode: str, cfg: TrainConfig, mode_cfg: Any, world_size: int, backend: str = ""
) -> dict:
    """What a checkpoint must agree on with the run resuming from it: the arithmetic and where it
    ran (backend, world size; the algorithm is a field of the sync rules), not the pace.

    Args:
        mode: "sync" or "async".
        cfg: the run's configuration.
        mode_cfg: its ``SyncConfig`` or ``AsyncConfig``.
        world_size: the number of ranks.
        backend: the transport, as --backend names it.

    Returns:
        A JSON-ready dict, stored in every checkpoint and compared on resume.
    """
    train = dataclasses.asdict(dataclasses.replace(cfg, steps=0))
    train.pop("steps")
    rules = {k: v for k, v in dataclasses.asdict(mode_cfg).items() if k not in _SPEED_FIELDS}
    return {"mode": mode, "backend": backend, "world_size": world_size, "train": train, mode: rules}


@dataclass(frozen=True)
class Expect:
    """Everything a run checks a checkpoint against before resuming from it.

    Args:
        meta: what the checkpoint's metadata must equal (``run_meta``).
        mode: "sync" or "async".
        steps: this run's steps (sync) or clocks per worker (async).
        cfg: the run's configuration.
        world_size: the number of ranks.
    """

    meta: dict  # must equal the checkpoint's meta (``run_meta``)
    mode: str  # "sync" | "async"
    steps: int  # this run's last step (sync) or clocks per worker (async)
    cfg: TrainConfig
    world_size: int

    def bounds(self) -> Bounds:
        """The most this run's checkpoint can hold: arrays of the model's size, and a manifest of
        the metadata plus, per step (sync) or per update of the server (async, at most clocks x
        workers), one loss or one log entry with its drop record. A larger file is not this
        run's.

        Returns:
            The largest array and manifest this run's checkpoint can hold.
        """
        itemsize = np.dtype(self.cfg.dtype).itemsize
        per_step = _LOSS_BYTES if self.mode == "sync" else _LOG_BYTES * max(self.world_size - 1, 1)
        manifest = _MANIFEST_BASE + len(json.dumps(self.meta, default=str)) + per_step * self.steps
        return Bounds(MLP(self.cfg.model).num_params * itemsize, min(manifest, _MANIFEST_MAX))

    @classmethod
    def of(
        cls, mode: str, cfg: TrainConfig, mode_cfg: Any, world_size: int, backend: str = ""
    ) -> Expect:
        """What a run of ``mode`` expects of the checkpoint it resumes from.

        Args:
            mode: "sync" or "async".
            cfg: the run's configuration.
            mode_cfg: its ``SyncConfig`` or ``AsyncConfig``.
            world_size: the number of ranks.
            backend: the transport, as --backend names it.

        Returns:
            The metadata to match, the steps the run takes, and the bounds that follow from them.
        """
        clocks = getattr(mode_cfg, "clocks", None)
        steps = cfg.steps if clocks is None else clocks
        return cls(run_meta(mode, cfg, mode_cfg, world_size, backend), mode, steps, cfg, world_size)


def load_resume(ckpt: CheckpointConfig | None, expect: Expect) -> Checkpoint | None:
    """The checkpoint to resume from, verified, self-consistent and of this run, or None to
    start afresh. Every refusal is a one-line ``CheckpointError`` saying what to do.

    Args:
        ckpt: the run's checkpoint settings, or None.
        expect: what this run expects (``Expect.of``).

    Returns:
        The checkpoint, or None when there is nothing to resume from.

    Raises:
        CheckpointError: a damaged checkpoint, one of another run, or one past this run's steps.
    """
    if ckpt is None or ckpt.resume is None:
        return None
    state = load_checkpoint(ckpt.resume, expect_meta=expect.meta, bounds=expect.bounds())
    check_consistent(state, expect)
    reached = _reached(state, expect.mode)
    if reached > expect.steps:
        unit = "step" if expect.mode == "sync" else "clock (per worker)"
        raise CheckpointError(f"checkpoint {state.path} is at {unit} {reached}, past this run's "
                              f"{expect.steps}: resume with --steps {reached} or more, or start "
                              "afresh")
    return state


def check_consistent(state: Checkpoint, expect: Expect) -> None:
    """The parts of one file must agree with each other and with the model they claim to be of."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {state.path} contradicts itself ({why}): it was not "
                               "written by this dplab's trainers; delete it or resume from an "
                               "earlier one")

    cfg, p = expect.cfg, state.params
    n = MLP(cfg.model).num_params
    if p.shape != (n,) or p.dtype != np.dtype(cfg.dtype):
        raise bad(f"parameters {p.dtype}{list(p.shape)}, the model needs {cfg.dtype}[{n}]")
    opt = state.optimizer_state
    names = set(
        make_optimizer(cfg.optimizer, n, cfg.dtype, MLP(cfg.model).param_slices).state_dict()
    )
    if set(opt) != names:
        raise bad(f"optimizer state {sorted(opt)}, {cfg.optimizer.name} keeps {sorted(names)}")
    for k, v in opt.items():
        if k != "step" and (
            not isinstance(v, np.ndarray) or v.shape != p.shape or v.dtype != p.dtype
        ):
            raise bad(f"optimizer {k!r} is {getattr(v, 'dtype', type(v).__name__)}"
                      f"{list(np.shape(v))}, the parameters {p.dtype}{list(p.shape)}")
    pos = state.data_position
    if not isinstance(pos, dict):
        raise bad("no data position")
    skipped = pos.get("skipped_steps", 0)  # mixed precision skips steps that overflowed
    if opt["step"] != state.step - skipped:
        raise bad(f"optimizer took {opt['step']} steps, the checkpoint is of step {state.step}"
                  + (f" with {skipped} skipped" if skipped else ""))
    if expect.mode == "sync":
        if pos.get("step") != state.step or len(pos.get("losses", ())) != state.step:
            raise bad(f"data position {pos.get('step')} with {len(pos.get('losses', ()))} losses, "
                      f"step {state.step}")
        return
    log, done = pos.get("log", []), pos.get("done", [])
    if pos.get("version") != state.step or len(done) != expect.world_size - 1 or \
            (log and log[-1][3] != state.step) or min(done, default=0) < 0:
        raise bad(f"server version {pos.get('version')}, {len(done)} workers' clocks, log up to "
                  f"version {log[-1][3] if log else 0}; step {state.step}")


def _reached(state: Checkpoint, mode: str) -> int:
    """How far the checkpoint got, in the unit of this run's limit: steps, or a worker's clocks."""
    pos = state.data_position
    return state.step if mode == "sync" else max(pos["done"], default=0)


def save_state(ckpt: CheckpointConfig, step: int, params: Any, opt_state: dict,
               position: dict, meta: dict) -> None:
    """One checkpoint; no RNG state: every random choice is a pure function of seeds and clocks.

    Args:
        ckpt: the run's checkpoint settings (with a directory).
        step: steps (or updates) done.
        params: the parameters.
        opt_state: the optimizer's ``state_dict()``.
        position: where the run is (step, losses, loss scale; the server's log and clocks).
        meta: ``run_meta`` of the run.

    Raises:
        ConfigError: a value a checkpoint cannot store.
        WriteError: the directory cannot take the file.
    """
    assert ckpt.directory is not None  # validate() guarantees it when every > 0
    save_checkpoint(ckpt.directory, step, params, opt_state, position, None, meta,
                    keep_last=ckpt.keep_last)
