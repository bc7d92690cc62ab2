"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

    from dplab.backends.launch.world import launch
    from dplab.reference.ps.trainer import AsyncConfig, train_async
    from dplab.reference.train.single import TrainConfig
    results = launch(train_async, 4, args=(TrainConfig(), AsyncConfig(staleness=2)))
    results[0].params, results[0].log     # the server's final parameters and its log

Rank 0 is the server, it owns the parameters; ranks 1..W (W = world_size - 1) are
workers. A worker repeats, for clock c = 0, 1, ..., clocks - 1:

    PULL     ask for the parameters, receive them and their VERSION (updates applied so far)
    COMPUTE  the gradient of its shard of global batch c, at that version
    PUSH     send the gradient, with the clock and the version it was computed on

The server applies every gradient the moment it arrives, so a gradient computed on
version v may land on version v + k: its DELAY is k, counted in UPDATES
(``LogEntry.delay``). Unbounded, a fast worker races ahead of a slow one and delays pile
up. Stale Synchronous Parallel (Ho et al., 2013) bounds the gap in CLOCKS instead, with one
rule, enforced by the server when it answers a pull (s = ``staleness``, in clocks):

    a pull for clock c is answered only once every worker has finished clock c - s - 1,
    i.e.  min over workers of clocks_done  >=  c - s

otherwise the reply waits until a push opens the gate. A fast worker (4 time units per
clock) beside a slow one (12 units per clock), with s = 1 (drawn by
``dplab.reference.pictures.render_timeline`` from events the SSP ``Gate`` decides:
``tests/test_pictures_docs.py``):

    time ->      0   4   8   12  16  20  24  28  32  36  40  44
    fast worker  [c0][c1]    [c2]        [c3]
    slow worker  [    c0    ][    c1    ][    c2    ][    c3    ]
                             ^           ^
                             |           slow has done 2 clocks: clock 3 may start
                             slow has done 1 clock: clock 2 may start (2 - 1 <= s)

s = 0 is lock-step (bulk synchronous), s = None never waits (fully asynchronous).
With ``aggregate=True`` (only with s = 0) the server sums the W gradients of a clock,
in worker order, and applies ONE update: synchronous data parallelism, equal to
``train_sync`` and ``train_single`` to rounding (1e-10 relative in float64), not to the
bit, since each adds the same gradients in its own order.

Backup workers (Chen et al., 2016, "Revisiting Distributed Synchronous SGD"): with
``aggregate=True, backup_workers=b`` the update of clock c is made from the FIRST W - b
gradients of clock c to arrive (summed in worker order); the b late ones are dropped
when they come (``AsyncResult.dropped``). Everyone's next pull is answered as soon as
clock c is applied, with the parameters of the current clock, so a worker whose
gradient was dropped skips straight to the step in progress: nobody waits for the
slowest, which is the point. b = 0 is plain aggregation, i.e. synchronous training.
W = 3 workers, b = 1, 8 clocks; worker 1 takes 13 time units per clock, workers 2 and 3
take 4 (drawn by ``dplab.reference.pictures.render_timeline`` from events built by the
server's own rules, ``Aggregator`` and ``decide``: ``tests/test_pictures_docs.py``):

    time ->   0         10        20        30
    worker 1  [     c0    ][     c3    ][     c6    ]
    worker 2  [c0][c1][c2][c3][c4][c5][c6][c7]
    worker 3  [c0][c1][c2][c3][c4][c5][c6][c7]
    server        ^   ^   ^x  ^   ^   ^ x ^   ^      x

    ^  the second gradient of a clock arrives: its update is applied (the version grows)
    x  a gradient arrives after its clock's update: dropped. Worker 1's c0 lands at 13,
       after c2's update: its next pull is answered at once with the clock in progress, c3

Workers 2 and 3 never wait for worker 1: 8 updates by time 32, where waiting for it
would take 104. Worker 1 computes c0, c3 and c6, and all three are dropped.

Scaling: the surviving gradients are summed and multiplied by global_batch / (samples
they cover), W / (W - b) for even shards: every step is a mean gradient, the step size
of synchronous training. The BIAS: the gradients dropped are systematically those of
the slowest workers, i.e. of their shards (worker w always trains on shard w - 1 of
each batch). With a persistent straggler its shard is never seen: the expected update
is the mean gradient over the fast workers' part of the data, not the full-batch
gradient, and data that only the straggler holds is under-represented. The log names
the workers of every update, so the replay reproduces this exactly.

Stragglers and budgets (``dplab.reference.train.straggler``): ``straggler=((w, f),)`` stretches worker
w's compute f times; rank 0 is the server and computes nothing, so naming it is a
ConfigError. With ``time_budget_s`` the server answers every pull after the budget with
STOP (with aggregation, after the clock in progress, whose update needs its pushes);
pushes already on their way are still applied and logged, and each worker leaves its
loop on STOP, so no rank waits forever. ``clocks`` remains the upper bound.

Data and learning rate: worker w at clock c trains on ``shard(batch c, w - 1, W)``, the
shard sync DP gives rank w - 1 at step c, with loss scale 1 / global_batch. Its gradient
is thus 1/W of a full-batch mean gradient (for even shards), and applying each push
right away with the configured optimizer is the classic "lr / workers" rule: per clock,
the W pushes together move the parameters about as far as one synchronous step.

The server logs every applied gradient (worker, clock, version computed on, version it
produced, the slowest worker's finished clocks when that pull was answered);
``dplab.reference.ps.replay`` recomputes the run from that log alone, bit for bit. The server's
loop is ``dplab.reference.ps.server``; the config, messages and shared arithmetic are in
``dplab.reference.ps.protocol``.

Protocol: every message between two ranks is received in the order it was sent (the
shared-memory backend matches strictly in order; MPI and torch match by tag, but no
tag here ever skips over an earlier message). A worker's push is a header and then its
gradient, and the server reads the gradient right after the header, so whenever the
server receives from ANY_SOURCE, the next message of every worker is a header.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import numpy as np

from dplab.reference.communicator import Communicator
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
    params: np.ndarray  # server: final parameters; worker: the last parameters it pulled
    log: list[LogEntry] = field(default_factory=list)  # server only
    events: list[Event] = field(default_factory=list)  # this rank's trace events, if tracing
    dropped: list[tuple[int, int]] = field(default_factory=list)  # server, backup workers: (worker, clock)
    lost: list[tuple[int, int]] = field(default_factory=list)  # server: dead (worker, clocks it finished)


_DEFAULT = AsyncConfig()  # lock-step, no budget, no stragglers


def train_async(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig = _DEFAULT) -> AsyncResult:
    """Run on every rank: rank 0 serves the parameters, the others compute gradients."""
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
    header, reply = np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64)  # reply: [version, clock]
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
            compute_gradient(model, data, cfg, params, worker_batch(cfg, me, workers, clock), grad)
        with tr.span("push", peer=0, bytes=grad.nbytes, extra=info):
            header[:] = (PUSH, clock, version)
            comm.send(header, 0, TAG_HEADER)
            comm.send(grad, 0, TAG_GRAD)
        clock += 1
    return params.copy()
