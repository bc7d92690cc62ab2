"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

    from dplab.backends.launch.world import launch
    from dplab.reference.ps.trainer import AsyncConfig, train_async
    from dplab.reference.train.single import TrainConfig
    results = launch(train_async, 4, args=(TrainConfig(), AsyncConfig(staleness=2)))
    results[0].params, results[0].log     # the server's final parameters and its log

Rank 0 serves the parameters; worker w = 1..W repeats PULL (parameters and their version),
COMPUTE (the gradient of shard w - 1 of global batch c, loss scale 1 / global_batch), PUSH
(with clock c). Contract: a pull for clock c is answered once every worker has finished clock
c - s - 1 (s = ``staleness``; 0 lock-step, None never waits); ``aggregate=True`` (s = 0) makes
one update per clock, within rounding of synchronous training; ``backup_workers=b`` makes it
from the first W - b gradients and drops the late ones (``AsyncResult.dropped``); after
``time_budget_s`` pulls get STOP; naming the server in ``straggler`` is a ConfigError; the
log replays bit for bit (``replay``). A fast and a slow worker, s = 1:

    time ->      0   4   8   12  16  20  24  28  32  36  40  44
    fast worker  [c0][c1]    [c2]        [c3]
    slow worker  [    c0    ][    c1    ][    c2    ][    c3    ]

Backup workers, W = 3, b = 1, worker 1 at 13 time units per clock (^ an update, x a drop):

    time ->   0         10        20        30
    worker 1  [     c0    ][     c3    ][     c6    ]
    worker 2  [c0][c1][c2][c3][c4][c5][c6][c7]
    worker 3  [c0][c1][c2][c3][c4][c5][c6][c7]
    server        ^   ^   ^x  ^   ^   ^ x ^   ^      x

Why it works, and the backups' bias: reference/README.md, "Asynchronous training". Every
message between two ranks arrives in the order it was sent, and a push's gradient is read
right after its header, so a receive from ANY_SOURCE always finds a header.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import numpy as np

from dplab.reference.communicator import Communicator
from dplab.reference.flops import model_ops
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
    combine,
    compute_gradient,
    delay_of,
    gate_open,
    update_gradient,
    worker_batch,
)
from dplab.reference.ps.server import serve
from dplab.reference.trace import Event
from dplab.reference.train.single import TrainConfig, setup
from dplab.reference.train.straggler import Slowdown

__all__ = ["AsyncConfig", "LogEntry", "AsyncResult", "train_async", "gate_open", "worker_batch",
           "compute_gradient", "combine", "update_gradient", "delay_of"]


@dataclass
class AsyncResult:
    """One rank's result of ``train_async``.

    Args:
        params: the server's final parameters, or the last a worker pulled.
        log: the server's log (empty on a worker).
        events: this rank's trace events, if tracing.
        dropped: the server's dropped (worker, clock) pushes.
        lost: the server's lost (worker, clocks finished) workers.
    """

    params: np.ndarray  # server: final parameters; worker: the last parameters it pulled
    log: list[LogEntry] = field(default_factory=list)  # server only
    events: list[Event] = field(default_factory=list)  # this rank's trace events, if tracing
    # server, backup workers: (worker, clock)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    # server: dead (worker, clocks it finished)
    lost: list[tuple[int, int]] = field(default_factory=list)


_DEFAULT = AsyncConfig()  # lock-step, no budget, no stragglers


def train_async(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig = _DEFAULT) -> AsyncResult:
    """Run on every rank: rank 0 serves the parameters, the others compute gradients.

    Args:
        comm: this rank's communicator (at least 2 ranks).
        cfg: the run's configuration.
        acfg: staleness, aggregation, stragglers, budget, checkpoints.

    Returns:
        Rank 0: the final parameters, the log, dropped pushes and lost workers; a worker: the last
        parameters it pulled. Each with this rank's trace events when tracing.

    Raises:
        ConfigError: an invalid configuration.
        CommError: a worker died where that cannot be survived, or a collective failed.
    """
    acfg.validate(comm.world_size)
    cfg.validate()
    clocks = cfg.steps if acfg.clocks is None else acfg.clocks
    first = len(comm.tracer.events)
    if comm.rank == 0:
        params, log, dropped, lost = serve(comm, cfg, acfg, clocks)
    else:
        params, log, dropped, lost = work(comm, cfg, acfg, clocks), [], [], []
    events = list(comm.tracer.events[first:]) if comm.tracer.enabled else []
    return AsyncResult(params, log, events, dropped, lost)


def work(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig, clocks: int) -> np.ndarray:
    """A worker's loop: pull, compute, push, until its last clock or until the server says STOP."""
    model, data, initial = setup(cfg)
    me, workers, tr = comm.rank, comm.world_size - 1, comm.tracer
    slow = Slowdown.for_rank(acfg.straggler, me, tr)
    params = initial  # replaced by every pull
    grad = comm.empty(model.num_params, initial.dtype)  # in shared memory: pushed without a copy
    # reply: [version, clock]
    header, reply = np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64)
    clock = 0  # the next clock to ask for; the server may hand out a later one (backup workers)
    while clock < clocks:
        t0 = tr.now()
        header[:] = (PULL, clock, -1)
        comm.send(header, 0, TAG_HEADER)
        comm.recv(reply, 0, TAG_REPLY)  # the server holds this back while the gate is shut
        version, clock = int(reply[0]), int(reply[1])
        info = {"clock": clock, "version": version}
        t1 = tr.now()
        tr.record("wait", t0, t1, peer=0, extra=info)
        if version == STOP:
            break
        comm.recv(params, 0, TAG_PARAMS)
        tr.record("pull", t1, tr.now(), peer=0, bytes=params.nbytes, extra=info)
        if acfg.kill_at == (me, clock):  # a fault test: die as a crash dies, with no goodbye
            os.kill(os.getpid(), signal.SIGKILL)
        with tr.span("compute", extra=info), slow.compute(delay_of(acfg, me, clock)):
            batch = worker_batch(cfg, me, workers, clock)
            compute_gradient(model, data, cfg, params, batch, grad)
            comm.compute(model_ops(model.cfg, len(batch), grad.itemsize), grad.dtype.name)  # sim
        with tr.span("push", peer=0, bytes=grad.nbytes, extra=info):
            header[:] = (PUSH, clock, version)
            comm.send(header, 0, TAG_HEADER)
            comm.send(grad, 0, TAG_GRAD)
        clock += 1
    return params.copy()
