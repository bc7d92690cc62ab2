"""The parameter server's side (rank 0): answer pulls at the gate, apply pushes, keep the log.

The behaviour is explained in ``dplab.reference.ps.trainer``; the rules are in ``gate.py``,
``aggregate.py``, ``lost.py`` and ``snapshot.py``. Each header from ANY worker is handled (a PULL
held, a PUSH applied or held for its clock), then the held pulls that may go are answered:

    SSP (aggregate=False)   clock c once the gate opens for it
    aggregate=True          once version >= c, with the CURRENT clock (a dropped worker skips ahead)
    budget spent / done     STOP: SSP at once; aggregate after the clock in progress

The loop ends when every worker has left, so no worker waits forever. A dead worker is
dropped from the gate and what it pushed stays logged; with ``aggregate=True`` it is an error
naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np

from dplab.reference.checkpoint.resume import Expect
from dplab.reference.communicator import ANY_SOURCE, CommError, Communicator
from dplab.reference.flops import optimizer_ops
from dplab.reference.optim import make_optimizer
from dplab.reference.ps.aggregate import Aggregator
from dplab.reference.ps.gate import Gate
from dplab.reference.ps.lost import POLL_S, Roster
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
    update_gradient,
)
from dplab.reference.ps.snapshot import Snapshots
from dplab.reference.train.single import TrainConfig, setup
from dplab.reference.train.straggler import Budget

__all__ = ["Server", "serve", "POLL_S"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class Server:
    """Rank 0's state: the parameters and their version, the held pulls, the log.

    Args:
        comm: rank 0's communicator.
        cfg: the run's configuration.
        acfg: the server's configuration.
        clocks: clocks every worker runs.
    """

    def __init__(
        self, comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig, clocks: int
    ) -> None:
        self.budget = Budget(acfg.time_budget_s)  # the clock starts now: set-up counts too
        model, _, initial = setup(cfg)
        self.comm, self.cfg, self.acfg, self.tr = comm, cfg, acfg, comm.tracer
        self.workers, self.clocks = comm.world_size - 1, clocks
        self.params = comm.empty(model.num_params, initial.dtype)
        self.params[:] = initial
        self.opt = make_optimizer(
            cfg.optimizer, model.num_params, initial.dtype, model.param_slices
        )
        self.grad = np.empty_like(initial)
        self.reply = np.zeros(2, dtype=np.int64)  # [version, clock] or [STOP, STOP]
        self.version = 0  # updates applied so far
        self.last_clock = clocks - 1  # aggregate: pulls handed a later clock are told to STOP
        self.stopping = False  # the budget is spent
        self.gate = Gate(self.workers, acfg.staleness)
        self.roster = Roster(comm, self.workers, clocks)
        self.pool = Aggregator(self.workers, acfg.backup_workers)  # used when acfg.aggregate
        self.waiting: list[tuple[int, int]] = []  # held pulls (worker, clock), in arrival order
        self.answered: dict[tuple[int, int], tuple[int, int]] = {}  # -> (version, slowest done)
        self.log: list[LogEntry] = []
        self.snapshots = Snapshots(acfg.checkpoint,
                                   Expect.of("async", cfg, acfg, comm.world_size, comm.backend))
        self.restore()

    def restore(self) -> None:
        """Resume from a checkpoint, if asked: workers then get their next unfinished clock."""
        state = self.snapshots.load()
        if state is not None:
            self.params[:] = state.params
            self.opt.load_state_dict(state.optimizer_state)
            self.version, self.gate.done, self.log = state.version, state.done, state.log
            self.pool.dropped = state.dropped

    def run(
        self,
    ) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]], list[tuple[int, int]]]:
        """Serve until every worker has left: final parameters, log, dropped pushes, lost
        workers.

        Returns:
            (parameters, log, dropped (worker, clock) pushes, lost (worker, clocks done) workers).

        Raises:
            CommError: a worker died under aggregation, or spoke another protocol.
            CommTimeout: nothing came within the timeout and no worker died.
        """
        header = np.zeros(3, dtype=np.int64)
        while self.roster.active:
            worker = self.listen(lambda: self.comm.recv(header, ANY_SOURCE, TAG_HEADER))
            kind, clock, version = (int(x) for x in header)
            if worker is None:  # silence: some worker was found dead, its gate reopened
                pass
            elif kind == PULL:
                # a resumed run's worker asks for 0: it gets its next unfinished clock
                self.waiting.append((worker, self.gate.next_clock(worker, clock)))
            elif (
                self.listen(partial(self.comm.recv, self.grad, worker, TAG_GRAD), worker)
                is not None
            ):
                self.take_push(worker, kind, clock, version)  # the gradient follows its header
            self.check_budget()
            self.release()
        return np.array(self.params), self.log, self.pool.dropped, sorted(self.roster.lost.items())

    # -- lost workers --------------------------------------------------------------------------
    def listen(self, call: Callable[[], T], peer: int | None = None) -> T | None:
        """``call()`` without hanging on the dead; None if ``peer`` (None: any worker) died.

        Args:
            call: a blocking receive or send.
            peer: the worker it waits on, or None for any.

        Returns:
            What ``call()`` returned, or None.

        Raises:
            CommError: a worker died under aggregation.
        """
        result = self.roster.listen(call, peer)
        for worker in self.roster.take_dead():
            self.lose(worker)
        return result

    def lose(self, worker: int) -> None:
        """Forget a dead worker: the gate waits for the living only;
        the log keeps what it pushed.

        Args:
            worker: the dead worker.

        Raises:
            CommError: under aggregation, which cannot go on without it.
        """
        reached = self.gate.forget(worker)
        if self.acfg.aggregate:
            raise CommError(
                f"worker rank {worker} died after finishing {reached} clocks: aggregation "
                "needs every worker each clock; use SSP (aggregate=False) to survive it"
            )
        self.roster.lose(worker, reached)
        self.waiting = [(w, c) for w, c in self.waiting if w != worker]
        now = self.tr.now()
        self.tr.record("lost", now, now, peer=worker, extra={"worker": worker, "clock": reached})
        log.warning("parameter server: worker rank %d died after finishing %d clocks; going on "
                    "with the %d others", worker, reached, self.workers - len(self.roster.lost))

    # -- pulls ---------------------------------------------------------------------------------
    def check_budget(self) -> None:
        """Once time is up, stop: SSP at once, aggregation after the clock in progress (needs its
        pushes)."""
        if not self.stopping and self.budget.spent():
            self.stopping = True
            self.last_clock = min(self.last_clock, self.version)

    def decide(self, clock: int) -> int | None:
        """The clock to hand a pull for ``clock``, STOP, or None to hold it at the gate.

        Args:
            clock: the clock the pull asked for.

        Returns:
            The clock to answer with, ``STOP``, or None.
        """
        if not self.acfg.aggregate:
            if self.stopping or clock >= self.clocks:
                return STOP
            return clock if self.gate.opens(clock) else None
        if self.version < clock:  # the update of clock - 1 is not applied yet
            return None
        return self.version if self.version <= self.last_clock else STOP

    def release(self) -> None:
        """Answer every held pull that may go now.

        A worker found dead while an answer is sent (``answer`` listens) is forgotten at once:
        that can open the gate for pulls already passed over in this scan, and drops the dead
        worker's own held pull. So scan again until a scan loses nobody, and take only the
        pulls still held."""
        lost = -1
        while lost != len(self.roster.lost):
            lost = len(self.roster.lost)
            for worker, clock in list(self.waiting):
                if (worker, clock) not in self.waiting:  # its worker was lost in this scan
                    continue
                given = self.decide(clock)
                if given is not None:
                    self.waiting.remove((worker, clock))
                    if given == STOP:
                        self.stop(worker)
                    else:
                        self.answer(worker, given)

    def stop(self, worker: int) -> None:
        """Tell ``worker`` to stop (its pull is answered with ``STOP``); it sends nothing more.

        Args:
            worker: the worker.
        """
        t0 = self.tr.now()
        self.reply[:] = STOP
        self.comm.send(self.reply, worker, TAG_REPLY)
        self.roster.leave(worker)
        self.tr.record("stop", t0, self.tr.now(), peer=worker, extra={"version": self.version})

    def answer(self, worker: int, clock: int) -> None:
        """Send ``worker`` the current version and parameters for ``clock`` (unless it dies
        meanwhile).

        Args:
            worker: the worker whose pull is answered.
            clock: the clock handed to it.
        """
        t0 = self.tr.now()
        self.answered[(worker, clock)] = (self.version, self.gate.slowest(default=clock))
        self.reply[:] = (self.version, clock)
        for buf, tag in ((self.reply, TAG_REPLY), (self.params, TAG_PARAMS)):
            if self.listen(self.comm.isend(buf, worker, tag).wait, worker) is None \
                    and worker in self.roster.lost:
                return
        self.tr.record("reply", t0, self.tr.now(), peer=worker, bytes=self.params.nbytes,
                       extra={"clock": clock, "version": self.version})

    # -- pushes --------------------------------------------------------------------------------
    def take_push(self, worker: int, kind: int, clock: int, version: int) -> None:
        """A gradient came: apply it (SSP), drop it (too late), or hold it for its clock's
        update.

        Args:
            worker: the worker that pushed.
            kind: the header's kind (must be ``PUSH``).
            clock: the clock the gradient is for.
            version: the parameter version it was computed on.

        Raises:
            CommError: a header that matches no answered pull.
        """
        if kind != PUSH or self.answered.get((worker, clock), (-1,))[0] != version:
            raise CommError(f"rank 0 got header {[kind, clock, version]} from rank {worker} that "
                            "matches no answered pull: the workers speak another protocol")
        self.gate.finish(worker, clock)
        if clock == self.clocks - 1:
            self.roster.leave(worker)  # its own loop is over: it sends nothing more
        if not self.acfg.aggregate:
            self.apply([(worker, clock)], [self.grad])
        elif self.pool.late(clock, self.version):
            # its clock was applied without it: a backup's fate
            self.drop(worker, clock)
        elif (ready := self.pool.hold(worker, clock, self.grad)) is not None:
            self.apply([(w, clock) for w, _ in ready], [g for _, g in ready])

    def apply(self, pushes: list[tuple[int, int]], grads: list[np.ndarray]) -> None:
        """One update from these pushes' gradients; each push gets its log entry.

        Args:
            pushes: (worker, clock) of each gradient.
            grads: the gradients, in the same order.
        """
        t0 = self.tr.now()
        self.opt.step(
            self.params, update_gradient(self.cfg, self.acfg, self.workers, pushes, grads)
        )
        # the update's time, on a sim cluster: sum the gradients, scale, then the optimizer's step
        n, item = len(self.params), self.params.itemsize
        combine = [(float(n * len(grads)), float(item * n * (len(grads) + 1)))]
        self.comm.compute(combine + optimizer_ops(self.cfg.optimizer.name, n, item),
                          self.params.dtype.name)
        self.version += 1
        t1 = self.tr.now()
        for worker, clock in pushes:
            v, slowest = self.answered.pop((worker, clock))
            self.log.append(LogEntry(worker, clock, v, self.version, slowest))
            self.tr.record("apply", t0, t1, peer=worker, extra={
                "delay": self.version - 1 - v, "worker": worker, "clock": clock,
                "version": self.version})
        self.snapshots.save_if_due(self.version, self.params, self.opt, self.gate.done, self.log,
                                   self.pool.dropped)

    def drop(self, worker: int, clock: int) -> None:
        """Log a gradient that came too late (backup workers): it is never applied.

        Args:
            worker: the worker that pushed it.
            clock: its clock.
        """
        t0 = self.tr.now()
        self.answered.pop((worker, clock))
        self.pool.drop(worker, clock)
        self.tr.record("drop", t0, self.tr.now(), peer=worker, extra={
            "worker": worker, "clock": clock, "version": self.version})


def serve(
    comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig, clocks: int
) -> tuple[np.ndarray, list[LogEntry], list[tuple[int, int]], list[tuple[int, int]]]:
    """The server's loop: final parameters, the log of applied gradients, the dropped ones, and
    the lost workers with the clocks they had finished.

    Args:
        comm: rank 0's communicator.
        cfg: the run's configuration.
        acfg: the server's configuration.
        clocks: clocks every worker runs.

    Returns:
        (parameters, log, dropped pushes, lost workers), as ``Server.run``.

    Raises:
        CommError: as ``Server.run``.
    """
    return Server(comm, cfg, acfg, clocks).run()
