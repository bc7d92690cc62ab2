"""The parameter server's side (rank 0): answer pulls at the gate, apply pushes, keep the log.

How it behaves is explained in ``dplab.reference.ps.trainer``; this file is the loop. Every
message is a header from ANY worker; the server reacts, then answers whichever held
pulls may now go. Three rules decide a held pull:

    SSP (aggregate=False)   answer clock c once the slowest worker has done c - staleness clocks
    aggregate=True          answer once the parameters of the clock asked for exist
                            (version >= c), and hand out the CURRENT clock, version:
                            with no backups that is c itself; with backups a worker
                            whose gradient was dropped skips ahead to the running step
    budget spent / done     answer STOP: SSP at once; aggregate after the clock in progress

A worker leaves after pushing its last clock or on receiving STOP; the loop ends when
every worker has left, so no worker is ever left waiting for an answer.

A worker that DIES (SIGKILL, a crash) is lost, not waited for: the server listens in
slices of ``POLL_S`` (``comm.patience``) and, whenever a slice passes in silence, asks
the transport which workers are still alive (``comm.peer_alive``). A dead one is removed
from the SSP gate (the slowest LIVE worker decides), its held pull and any push it never
finished are forgotten, and ``lost`` records it with the clocks it had finished (also a
"lost" trace event and a warning). Everything it pushed before dying stays applied and
logged, so the replay property holds unchanged. Limits: the shared-memory backend can
tell dead from slow; MPI aborts the whole job when a rank dies, and torch (gloo/NCCL)
turns a dead peer into an error of the call, so there a lost worker ends the run with a
clear error naming the rank. With ``aggregate=True`` every clock needs every worker's
gradient, so a lost worker is an error there too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
from dplab.reference.checkpoint.resume import load_resume, run_meta, save_state
from dplab.reference.communicator import ANY_SOURCE, CommError, CommTimeout, Communicator
from dplab.reference.optim import make_optimizer
from dplab.reference.ps.protocol import (
    PULL,
    PUSH,
    STOP,
    TAG_GRAD,
    TAG_HEADER,
    TAG_PARAMS,
    TAG_REPLY,
    AsyncConfig,
    LogEntry,
    gate_open,
    update_gradient,
)
from dplab.reference.train.single import TrainConfig, setup
from dplab.reference.train.straggler import Budget

__all__ = ["Server", "serve", "POLL_S"]

POLL_S = 0.05  # seconds of silence after which the server checks that its workers are alive
T = TypeVar("T")
log = logging.getLogger(__name__)


class Server:
    """Rank 0's state: the parameters and their version, the held pulls, the log."""

    def __init__(self, comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig, clocks: int) -> None:
        self.budget = Budget(acfg.time_budget_s)  # the clock starts now: set-up counts too
        model, _, initial = setup(cfg)
        self.comm, self.cfg, self.acfg, self.tr = comm, cfg, acfg, comm.tracer
        self.workers, self.clocks = comm.world_size - 1, clocks
        self.params = comm.empty(model.num_params, initial.dtype)
        self.params[:] = initial
        self.opt = make_optimizer(cfg.optimizer, model.num_params, initial.dtype)
        self.grad = np.empty_like(initial)
        self.reply = np.zeros(2, dtype=np.int64)  # [version, clock] or [STOP, STOP]
        self.done = [0] * self.workers  # per worker: its last pushed clock + 1
        self.version = 0  # updates applied so far
        self.last_clock = clocks - 1  # aggregate: pulls handed a later clock are told to STOP
        self.stopping = False  # the budget is spent
        self.active = set(range(1, self.workers + 1)) if clocks > 0 else set()  # will still send
        self.waiting: list[tuple[int, int]] = []  # held pulls (worker, clock), in arrival order
        self.answered: dict[tuple[int, int], tuple[int, int]] = {}  # -> (version, slowest done)
        self.held: dict[int, dict[int, np.ndarray]] = {}  # aggregate: clock -> worker -> gradient
        self.log: list[LogEntry] = []
        self.dropped: list[tuple[int, int]] = []  # backup workers: (worker, clock) arrived too late
        self.lost: dict[int, int] = {}  # dead workers -> the clocks they had finished
        self.meta = run_meta("async", cfg, acfg, comm.world_size)
        self.restore()

    # -- checkpoints ---------------------------------------------------------------------------
    def restore(self) -> None:
        """Resume from a checkpoint: workers then get their next unfinished clock (``decide``)."""
        state = load_resume(self.acfg.checkpoint, self.meta)
        if state is None:
            return
        self.params[:] = state.params
        self.opt.load_state_dict(state.optimizer_state)
        pos = state.data_position
        self.version, self.done = int(pos["version"]), [int(c) for c in pos["done"]]
        self.log = [LogEntry(*(int(v) for v in e)) for e in pos["log"]]
        self.dropped = [(int(w), int(c)) for w, c in pos["dropped"]]

    def save(self) -> None:
        """Everything the server knows, after an update; pulls and pushes in flight are redone."""
        ckpt = self.acfg.checkpoint
        if ckpt is None or not ckpt.due(self.version):
            return
        position = {"version": self.version, "done": self.done, "dropped": self.dropped,
                    "log": [[e.worker, e.clock, e.version, e.produced, e.slowest_done] for e in self.log]}
        save_state(ckpt, self.version, self.params, self.opt.state_dict(), position, self.meta)

    def run(self) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]], list[tuple[int, int]]]:
        header = np.zeros(3, dtype=np.int64)
        while self.active:
            worker = self.patiently(lambda: self.comm.recv(header, ANY_SOURCE, TAG_HEADER))
            kind, clock, version = (int(x) for x in header)
            if worker is None:  # silence: some worker was found dead, its gate reopened
                pass
            elif kind == PULL:  # a resumed run's worker asks for 0: it gets its next unfinished clock
                self.waiting.append((worker, max(clock, self.done[worker - 1])))
            elif self.patiently(partial(self.comm.recv, self.grad, worker, TAG_GRAD), worker) is not None:
                self.take_push(worker, kind, clock, version)  # the gradient follows its header
            self.check_budget()
            self.release()
        return np.array(self.params), self.log, self.dropped, sorted(self.lost.items())

    # -- lost workers --------------------------------------------------------------------------
    def patiently(self, call: Callable[[], T], peer: int | None = None) -> T | None:
        """``call()``, listening in slices of POLL_S; None if ``peer`` (or, for None, any worker)
        died meanwhile. Silence with every worker alive is only an error after ``timeout``."""
        deadline = time.monotonic() + self.comm.timeout
        while True:
            try:
                with self.comm.patience(POLL_S):
                    return call()
            except CommTimeout:
                if time.monotonic() >= deadline:
                    raise
            dead = [w for w in sorted(self.active) if not self.comm.peer_alive(w)]
            for w in dead:
                self.lose(w)
            if dead and (peer is None or peer in dead):
                return None

    def lose(self, worker: int) -> None:
        """Forget a dead worker: the gate waits for the living only; the log keeps what it pushed."""
        reached = self.done[worker - 1]
        if self.acfg.aggregate:
            raise CommError(f"worker rank {worker} died after finishing {reached} clocks: aggregation "
                            "needs every worker each clock; use SSP (aggregate=False) to survive it")
        self.lost[worker] = reached
        self.active.discard(worker)
        self.waiting = [(w, c) for w, c in self.waiting if w != worker]
        now = self.tr.now()
        self.tr.record("lost", now, now, peer=worker, extra={"worker": worker, "clock": reached})
        log.warning("parameter server: worker rank %d died after finishing %d clocks; going on with "
                    "the %d others", worker, reached, self.workers - len(self.lost))

    def live_done(self) -> list[int]:
        return [d for w, d in enumerate(self.done, 1) if w not in self.lost]

    # -- pulls ---------------------------------------------------------------------------------
    def check_budget(self) -> None:
        """Once time is up, stop: SSP at once, aggregation after the clock in progress (needs its pushes)."""
        if not self.stopping and self.budget.spent():
            self.stopping = True
            self.last_clock = min(self.last_clock, self.version)

    def decide(self, clock: int) -> int | None:
        """The clock to hand a pull for ``clock``, STOP, or None to hold it at the gate."""
        if not self.acfg.aggregate:
            if self.stopping or clock >= self.clocks:
                return STOP
            return clock if gate_open(self.live_done(), clock, self.acfg.staleness) else None
        if self.version < clock:  # the update of clock - 1 is not applied yet
            return None
        return self.version if self.version <= self.last_clock else STOP

    def release(self) -> None:
        for worker, clock in list(self.waiting):
            given = self.decide(clock)
            if given is not None:
                self.waiting.remove((worker, clock))
                self.answer(worker, given)

    def answer(self, worker: int, clock: int) -> None:
        t0 = self.tr.now()
        if clock == STOP:
            self.reply[:] = STOP
            self.comm.send(self.reply, worker, TAG_REPLY)
            self.active.discard(worker)
            self.tr.record("stop", t0, self.tr.now(), peer=worker, extra={"version": self.version})
            return
        self.answered[(worker, clock)] = (self.version, min(self.live_done(), default=clock))
        self.reply[:] = (self.version, clock)
        for buf, tag in ((self.reply, TAG_REPLY), (self.params, TAG_PARAMS)):
            if self.patiently(self.comm.isend(buf, worker, tag).wait, worker) is None \
                    and worker in self.lost:
                return
        self.tr.record("reply", t0, self.tr.now(), peer=worker, bytes=self.params.nbytes,
                       extra={"clock": clock, "version": self.version})

    # -- pushes --------------------------------------------------------------------------------
    def take_push(self, worker: int, kind: int, clock: int, version: int) -> None:
        if kind != PUSH or self.answered.get((worker, clock), (-1,))[0] != version:
            raise CommError(f"rank 0 got header {[kind, clock, version]} from rank {worker} that "
                            "matches no answered pull: the workers speak another protocol")
        self.done[worker - 1] = clock + 1
        if clock == self.clocks - 1:
            self.active.discard(worker)  # its own loop is over: it sends nothing more
        if not self.acfg.aggregate:
            self.apply([(worker, clock)], [self.grad])
        elif clock < self.version:  # its clock was applied without it: a backup worker's fate
            self.drop(worker, clock)
        else:
            held = self.held.setdefault(clock, {})
            held[worker] = self.grad.copy()
            if len(held) == self.workers - self.acfg.backup_workers:
                ready = sorted(self.held.pop(clock).items())  # worker order: a fixed sum
                self.apply([(w, clock) for w, _ in ready], [g for _, g in ready])

    def apply(self, pushes: list[tuple[int, int]], grads: list[np.ndarray]) -> None:
        t0 = self.tr.now()
        self.opt.step(self.params, update_gradient(self.cfg, self.acfg, self.workers, pushes, grads))
        self.version += 1
        t1 = self.tr.now()
        for worker, clock in pushes:
            v, slowest = self.answered.pop((worker, clock))
            self.log.append(LogEntry(worker, clock, v, self.version, slowest))
            self.tr.record("apply", t0, t1, peer=worker, extra={
                "staleness": self.version - 1 - v, "worker": worker, "clock": clock,
                "version": self.version})
        self.save()

    def drop(self, worker: int, clock: int) -> None:
        t0 = self.tr.now()
        self.answered.pop((worker, clock))
        self.dropped.append((worker, clock))
        self.tr.record("drop", t0, self.tr.now(), peer=worker, extra={
            "worker": worker, "clock": clock, "version": self.version})


def serve(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig,
          clocks: int) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]], list[tuple[int, int]]]:
    """The server's loop: final parameters, the log of applied gradients, the dropped ones, and
    the lost workers with the clocks they had finished."""
    return Server(comm, cfg, acfg, clocks).run()
