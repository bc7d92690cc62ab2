"""The parameter server's side (rank 0): answer pulls at the gate, apply pushes, keep the log.

How it behaves is explained in ``reference.async_ps``; this file is the loop. Every
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
"""

from __future__ import annotations

import numpy as np

from reference.communicator import ANY_SOURCE, CommError, Communicator
from reference.optim import make_optimizer
from reference.ps_protocol import (
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
from reference.straggler import Budget
from reference.train import TrainConfig, setup

__all__ = ["Server", "serve"]


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

    def run(self) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]]]:
        header = np.zeros(3, dtype=np.int64)
        while self.active:
            worker = self.comm.recv(header, ANY_SOURCE, TAG_HEADER)
            kind, clock, version = (int(x) for x in header)
            if kind == PULL:
                self.waiting.append((worker, clock))
            else:
                self.comm.recv(self.grad, worker, TAG_GRAD)  # always right after its header
                self.take_push(worker, kind, clock, version)
            self.check_budget()
            self.release()
        return np.array(self.params), self.log, self.dropped

    # -- pulls ---------------------------------------------------------------------------------
    def check_budget(self) -> None:
        """Once time is up, stop: SSP at once, aggregation after the clock in progress (needs its pushes)."""
        if not self.stopping and self.budget.spent():
            self.stopping = True
            self.last_clock = min(self.last_clock, self.version)

    def decide(self, clock: int) -> int | None:
        """The clock to hand a pull for ``clock``, STOP, or None to hold it at the gate."""
        if not self.acfg.aggregate:
            if self.stopping:
                return STOP
            return clock if gate_open(self.done, clock, self.acfg.staleness) else None
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
        self.answered[(worker, clock)] = (self.version, min(self.done))
        self.reply[:] = (self.version, clock)
        self.comm.send(self.reply, worker, TAG_REPLY)
        self.comm.send(self.params, worker, TAG_PARAMS)
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

    def drop(self, worker: int, clock: int) -> None:
        t0 = self.tr.now()
        self.answered.pop((worker, clock))
        self.dropped.append((worker, clock))
        self.tr.record("drop", t0, self.tr.now(), peer=worker, extra={
            "worker": worker, "clock": clock, "version": self.version})


def serve(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig,
          clocks: int) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]]]:
    """The server's loop: final parameters, the log of applied gradients, the dropped ones."""
    return Server(comm, cfg, acfg, clocks).run()
