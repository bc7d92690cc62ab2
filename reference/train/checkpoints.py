"""Checkpoints and resume for ``train_sync``, as a hook (what a checkpoint holds:
``checkpoint/resume.py``).

Every replica is the same bits, so rank 0 alone writes, after every ``every`` steps; on resume
every rank reads the same file and starts equal again, at the step after it.
"""

from __future__ import annotations

from typing import Any

from dplab.reference.checkpoint.resume import CheckpointConfig, Expect, load_resume, save_state
from dplab.reference.communicator import Communicator
from dplab.reference.train.hooks import Hook, Run
from dplab.reference.train.single import TrainConfig, check_finite

__all__ = ["Checkpoints"]


class Checkpoints(Hook):
    """Resume from ``ckpt.resume`` at the start; rank 0 saves when ``ckpt.due``.

    ``sync``: the run's ``SyncConfig`` (a checkpoint must agree with its arithmetic); ``amp``: its
    mixed precision hook, whose loss scale a checkpoint keeps (None without).

    Args:
        comm: this rank's communicator.
        cfg: the run's configuration.
        sync: the run's ``SyncConfig``.
        ckpt: where and how often to save, and what to resume from.
        amp: the run's ``Amp`` hook, or None.
    """

    def __init__(self, comm: Communicator, cfg: TrainConfig, sync: Any, ckpt: CheckpointConfig,
                 amp: Any = None) -> None:
        self.comm, self.ckpt, self.amp = comm, ckpt, amp
        self.expect = Expect.of("sync", cfg, sync, comm.world_size, comm.backend)

    def on_start(self, run: Run) -> None:
        state = load_resume(self.ckpt, self.expect)
        if state is None:
            return
        run.params[:] = state.params
        run.opt.load_state_dict(state.optimizer_state)
        if self.amp is not None:
            self.amp.load_state_dict(state.data_position)
        run.losses[:] = [float(v) for v in state.data_position["losses"]]
        run.start = int(state.data_position["step"])

    def after_step(self, run: Run, step: int) -> None:
        if not self.ckpt.due(step + 1):
            return
        # on every rank: a diverged run is not kept
        check_finite(run.params, run.losses, ended=False)
        if self.comm.rank != 0:
            return
        amp = {} if self.amp is None else self.amp.state_dict()
        position = {"step": step + 1, "losses": run.losses, **amp}
        save_state(
            self.ckpt, step + 1, run.params, run.opt.state_dict(), position, self.expect.meta
        )
