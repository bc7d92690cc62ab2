"""The parameter server's checkpoints: what it writes every k updates, and how it picks up again.

A server checkpoint is the server's whole knowledge after an update: parameters,
optimizer state, the version (updates applied), each worker's finished clocks, the log
so far and the pushes dropped as too late. Pulls and pushes in flight are not in it:
after a resume each worker is handed its next unfinished clock (``Gate.next_clock``)
and recomputes what was lost. The combined log (the checkpoint's, then the resumed
run's) replays to the final parameters bit for bit (``dplab.reference.ps.replay``).
Storage and the checks a checkpoint must pass are ``dplab.reference.checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dplab.reference.checkpoint.resume import CheckpointConfig, Expect, load_resume, save_state
from dplab.reference.optim import Optimizer
from dplab.reference.ps.protocol import LogEntry

__all__ = ["ServerState", "Snapshots"]


@dataclass
class ServerState:
    """What a checkpoint gives back to the server.

    Args:
        params: the parameters.
        optimizer_state: the optimizer's state.
        version: updates applied.
        done: each worker's finished clocks.
        log: the applied gradients, in order.
        dropped: (worker, clock) pushes dropped.
    """

    params: np.ndarray
    optimizer_state: dict
    version: int
    done: list[int]  # per worker: clocks finished
    log: list[LogEntry]
    dropped: list[tuple[int, int]]


class Snapshots:
    """Save the server's state every ``ckpt.every`` updates; load it back on resume.

    Args:
        ckpt: the server's checkpoint settings, or None.
        expect: what this run expects of a checkpoint.
    """

    def __init__(self, ckpt: CheckpointConfig | None, expect: Expect) -> None:
        self.ckpt, self.expect = ckpt, expect

    def load(self) -> ServerState | None:
        """The server's state from the checkpoint to resume from, or None to start afresh.

        Returns:
            The parameters, optimizer state, version, finished clocks, log and dropped pushes.

        Raises:
            CheckpointError: a damaged checkpoint, one of another run, or one past this run's
                clocks (``load_resume``).
        """
        state = load_resume(self.ckpt, self.expect)
        if state is None:
            return None
        pos = state.data_position
        log = [LogEntry(*(int(v) for v in e)) for e in pos["log"]]
        return ServerState(
            state.params,
            state.optimizer_state,
            int(pos["version"]),
            [int(c) for c in pos["done"]],
            log,
            [(int(w), int(c)) for w, c in pos["dropped"]],
        )

    def save_if_due(self, version: int, params: np.ndarray, opt: Optimizer, done: list[int],
                    log: list[LogEntry], dropped: list[tuple[int, int]]) -> None:
        """Save the server's whole state if ``version`` is a checkpoint's turn.

        Args:
            version: updates applied so far.
            params: the parameters.
            opt: the optimizer (its state is saved).
            done: each worker's finished clocks.
            log: the log so far.
            dropped: the dropped pushes so far.
        """
        if self.ckpt is None or not self.ckpt.due(version):
            return
        position = {
            "version": version,
            "done": done,
            "dropped": dropped,
            "log": [[e.worker, e.clock, e.version, e.produced, e.slowest_done] for e in log],
        }
        save_state(self.ckpt, version, params, opt.state_dict(), position, self.expect.meta)
