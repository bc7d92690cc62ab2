"""Checkpoint and resume for the data-parallel trainers: stop anywhere, go on exactly.

    from dplab.reference.checkpoint.resume import CheckpointConfig
    ckpt = CheckpointConfig(every=2, directory="ckpts")            # write every 2 steps
    launch(train_sync, 4, args=(cfg, SyncConfig(checkpoint=ckpt)))
    again = CheckpointConfig(every=2, directory="ckpts", resume="ckpts")   # after a crash

Storage is ``dplab.reference.checkpoint.store`` (atomic, checksummed, no pickle); this file decides
WHAT a trainer saves, and what a checkpoint must agree on before a run picks up from it.

Synchronous (``dplab.reference.train.sync``): every replica is identical, so rank 0 alone writes,
after step t: the parameters, the optimizer state, the data position (steps done, and
the losses so far so that the resumed run reports the whole run) and the step. On
resume EVERY rank loads the same file, so all replicas start equal again. There is no
RNG state to keep: the batch of step t is a pure function of (seed, t), and that is
what makes the resumed run's final parameters BITWISE identical to an uninterrupted run's
(the same operations on the same bits; both are within rounding, 1e-10 relative in
float64, of one device).

Asynchronous (``dplab.reference.ps.snapshot``): the server writes, every ``every`` updates, its
parameters, optimizer state, version, each worker's finished clocks, the log so far and
the dropped pushes. On resume it restores them and hands each worker, whatever clock it
asks for, its next unfinished clock; gradients that were in flight at the crash are
simply computed again. An asynchronous run is not reproducible by re-running it (the
interleaving depends on timing), so "exactly" means what it means for any async run:
the COMBINED log (the checkpoint's prefix, then what the resumed run appended) replays
on one device to the final parameters, bit for bit (``dplab.reference.ps.replay``).

What a resumed run must share with the checkpoint (``Expect``), one rule for all of it:
REFUSE, with one line naming the field, never a silent approximation. The rule covers
the arithmetic (model, data, seed, optimizer, dtype, staleness ...) AND where it ran: the
backend, the world size and the all-reduce algorithm. Another world size cuts other
shards, another algorithm or backend adds in another order; the result would still be
within rounding of one device, but no longer bitwise the uninterrupted run, which is what
a checkpoint promises. To change them, start afresh (or train on from the saved
parameters as a new run). Left out are steps, clocks, stragglers, delays and time
budgets: they change how far or how fast a run goes, not a step's arithmetic, so a run
may be resumed to train LONGER, never shorter: a checkpoint past this run's last step is
refused (it would hand back later parameters under a smaller step count). A time budget
starts afresh in the resumed run. A file that passes its checksum must still agree with
itself (parameters against the model and dtype, optimizer state against the parameters,
step against optimizer and data position): otherwise it is refused too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from dplab.reference.checkpoint.store import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP
from dplab.reference.optim import make_optimizer
from dplab.reference.train.single import TrainConfig

__all__ = ["CheckpointConfig", "Expect", "run_meta", "load_resume", "save_state"]

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


def run_meta(mode: str, cfg: TrainConfig, mode_cfg: Any, world_size: int, backend: str = "") -> dict:
    """What a checkpoint must agree on with the run resuming from it: the arithmetic and where it
    ran (backend, world size; the algorithm is a field of the sync rules), not the pace."""
    train = dataclasses.asdict(dataclasses.replace(cfg, steps=0))
    train.pop("steps")
    rules = {k: v for k, v in dataclasses.asdict(mode_cfg).items() if k not in _SPEED_FIELDS}
    return {"mode": mode, "backend": backend, "world_size": world_size, "train": train, mode: rules}


@dataclass(frozen=True)
class Expect:
    """Everything a run checks a checkpoint against before resuming from it."""

    meta: dict  # must equal the checkpoint's meta (``run_meta``)
    mode: str  # "sync" | "async"
    steps: int  # this run's last step (sync) or clocks per worker (async)
    cfg: TrainConfig
    world_size: int

    @classmethod
    def of(cls, mode: str, cfg: TrainConfig, mode_cfg: Any, world_size: int, backend: str = "") -> Expect:
        clocks = getattr(mode_cfg, "clocks", None)
        steps = cfg.steps if clocks is None else clocks
        return cls(run_meta(mode, cfg, mode_cfg, world_size, backend), mode, steps, cfg, world_size)


def load_resume(ckpt: CheckpointConfig | None, expect: Expect) -> Checkpoint | None:
    """The checkpoint to resume from, verified, self-consistent and of this run, or None to
    start afresh. Every refusal is a one-line ``CheckpointError`` saying what to do."""
    if ckpt is None or ckpt.resume is None:
        return None
    state = load_checkpoint(ckpt.resume, expect_meta=expect.meta)
    check_consistent(state, expect)
    reached = _reached(state, expect.mode)
    if reached > expect.steps:
        unit = "step" if expect.mode == "sync" else "clock (per worker)"
        raise CheckpointError(f"checkpoint {state.path} is at {unit} {reached}, past this run's "
                              f"{expect.steps}: resume with --steps {reached} or more, or start afresh")
    return state


def check_consistent(state: Checkpoint, expect: Expect) -> None:
    """The parts of one file must agree with each other and with the model they claim to be of."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {state.path} contradicts itself ({why}): it was not "
                               "written by this dplab's trainers; delete it or resume from an earlier one")

    cfg, p = expect.cfg, state.params
    n = MLP(cfg.model).num_params
    if p.shape != (n,) or p.dtype != np.dtype(cfg.dtype):
        raise bad(f"parameters {p.dtype}{list(p.shape)}, the model needs {cfg.dtype}[{n}]")
    opt = state.optimizer_state
    names = set(make_optimizer(cfg.optimizer, n, cfg.dtype, MLP(cfg.model).param_slices).state_dict())
    if set(opt) != names:
        raise bad(f"optimizer state {sorted(opt)}, {cfg.optimizer.name} keeps {sorted(names)}")
    for k, v in opt.items():
        if k != "step" and (not isinstance(v, np.ndarray) or v.shape != p.shape or v.dtype != p.dtype):
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
    """One checkpoint; no RNG state: every random choice is a pure function of seeds and clocks."""
    assert ckpt.directory is not None  # validate() guarantees it when every > 0
    save_checkpoint(ckpt.directory, step, params, opt_state, position, None, meta,
                    keep_last=ckpt.keep_last)
