"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

    from backends.launch import launch
    from reference.async_ps import AsyncConfig, train_async
    from reference.train import TrainConfig
    results = launch(train_async, 4, args=(TrainConfig(), AsyncConfig(staleness=2)))
    results[0].params, results[0].log     # the server's final parameters and its log

Rank 0 is the server, it owns the parameters; ranks 1..W (W = world_size - 1) are
workers. A worker repeats, for clock c = 0, 1, ..., clocks - 1:

    PULL     ask for the parameters, receive them and their VERSION (updates applied so far)
    COMPUTE  the gradient of its shard of global batch c, at that version
    PUSH     send the gradient, with the clock and the version it was computed on

The server applies every gradient the moment it arrives, so a gradient computed on
version v may land on version v + k: it is k updates STALE. Unbounded, a fast worker
races ahead of a slow one and stale gradients pile up. Stale Synchronous Parallel (Ho
et al., 2013) bounds that with one rule, enforced by the server when it answers a pull:

    a pull for clock c is answered only once every worker has finished clock c - s - 1,
    i.e.  min over workers of clocks_done  >=  c - s           (s = staleness)

otherwise the reply waits until a push opens the gate. A fast worker (1 time unit per
clock) beside a slow one (3 units per clock), with s = 1:

    time ->        0   1   2   3   4   5   6   7   8   9
    fast worker    [c0][c1]....[c2]........[c3]
    slow worker    [    c0    ][    c1    ][    c2    ]
                               ^           ^
                               |           slow has done 2 clocks: clock 3 may start
                               slow has done 1 clock: clock 2 may start (2 - 1 <= s)

s = 0 is lock-step (bulk synchronous), s = None never waits (fully asynchronous).
With ``aggregate=True`` (only with s = 0) the server sums the W gradients of a clock,
in worker order, and applies ONE update: exactly synchronous data parallelism.

Data and learning rate: worker w at clock c trains on ``shard(batch c, w - 1, W)``, the
shard sync DP gives rank w - 1 at step c, with loss scale 1 / global_batch. Its gradient
is thus 1/W of a full-batch mean gradient (for even shards), and applying each push
right away with the configured optimizer is the classic "lr / workers" rule: per clock,
the W pushes together move the parameters about as far as one synchronous step.

The server logs every applied gradient (worker, clock, version computed on, version it
produced, the slowest worker's finished clocks when that pull was answered);
``reference.replay`` recomputes the run from that log alone, bit for bit.

Protocol: every message between two ranks is received in the order it was sent (the
shared-memory backend matches strictly in order; MPI and torch match by tag, but no
tag here ever skips over an earlier message). A worker's push is a header and then its
gradient, and the server reads the gradient right after the header, so whenever the
server receives from ANY_SOURCE, the next message of every worker is a header.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from reference.communicator import ANY_SOURCE, CommError, Communicator
from reference.data import Dataset, batch_indices, shard
from reference.errors import ConfigError
from reference.model import MLP
from reference.optim import make_optimizer
from reference.trace import Event
from reference.train import TrainConfig, setup

__all__ = ["AsyncConfig", "LogEntry", "AsyncResult", "train_async", "gate_open", "worker_batch",
           "compute_gradient", "combine"]

PULL, PUSH = 1, 2  # header kinds: int64 [kind, clock, version]
TAG_HEADER, TAG_GRAD, TAG_REPLY, TAG_PARAMS = 11, 12, 13, 14


@dataclass(frozen=True)
class AsyncConfig:
    staleness: int | None = 0  # clocks a worker may run ahead of the slowest; None: unbounded
    clocks: int | None = None  # clocks per worker; None: TrainConfig.steps
    aggregate: bool = False  # one summed update per clock (needs staleness=0): sync DP
    delays: tuple[float, ...] | None = None  # seconds worker w sleeps before each compute: delays[w-1]
    max_delay_s: float = 0.0  # plus a random sleep in [0, max_delay_s), seeded by delay_seed
    delay_seed: int = 0

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def validate(self, world_size: int | None = None) -> None:
        s = self.staleness
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ConfigError(f"staleness must be an integer >= 0, or None for fully asynchronous, got {s!r}")
        if self.clocks is not None and self.clocks < 0:
            raise ConfigError(f"clocks must be >= 0 (or None to use TrainConfig.steps), got {self.clocks}")
        if self.aggregate and s != 0:
            raise ConfigError(f"aggregate=True sums each clock's gradients, which needs lock-step "
                              f"workers: set staleness=0 (got {s!r}) or aggregate=False")
        if self.delays is not None and not all(math.isfinite(d) and d >= 0 for d in self.delays):
            raise ConfigError(f"delays must be finite seconds >= 0, got {self.delays}")
        if not (math.isfinite(self.max_delay_s) and self.max_delay_s >= 0) or self.delay_seed < 0:
            raise ConfigError(f"need max_delay_s >= 0 and delay_seed >= 0, got {self.max_delay_s}, "
                              f"{self.delay_seed}")
        if world_size is not None and world_size < 2:
            raise ConfigError(f"the parameter server needs world_size >= 2 (rank 0 serves, ranks "
                              f"1.. work), got {world_size}: launch at least 2 ranks")
        if world_size is not None and self.delays is not None and len(self.delays) != world_size - 1:
            raise ConfigError(f"delays needs one entry per worker ({world_size - 1} for world_size "
                              f"{world_size}), got {len(self.delays)}")


@dataclass(frozen=True)
class LogEntry:
    """One applied gradient, in the order the server applied it."""

    worker: int  # 1..W
    clock: int
    version: int  # parameter version the gradient was computed on
    produced: int  # version after applying it (shared by a clock's gradients when aggregating)
    slowest_done: int  # min over workers of clocks done when this worker's pull was answered

    @property
    def staleness(self) -> int:
        """Updates applied between the pull and this gradient's own update."""
        return self.produced - 1 - self.version


@dataclass
class AsyncResult:
    params: np.ndarray  # server: final parameters; worker: the last parameters it pulled
    log: list[LogEntry] = field(default_factory=list)  # server only
    events: list[Event] = field(default_factory=list)  # this rank's trace events, if tracing


# -- pieces shared with reference.replay: same functions, same arithmetic, same bits ---------

def gate_open(done: list[int], clock: int, staleness: int | None) -> bool:
    """SSP: a worker may start ``clock`` once the slowest has finished ``clock - staleness`` clocks."""
    return staleness is None or min(done) >= clock - staleness


def worker_batch(cfg: TrainConfig, worker: int, workers: int, clock: int) -> np.ndarray:
    """Worker w's samples at clock c: sync DP's shard of rank w - 1 at step c."""
    return shard(batch_indices(cfg.num_samples, cfg.global_batch, clock, cfg.seed), worker - 1, workers)


def compute_gradient(model: MLP, data: Dataset, cfg: TrainConfig, params: np.ndarray,
                     idx: np.ndarray, grad: np.ndarray) -> float:
    """Overwrite ``grad`` with the shard's gradient (loss scale 1 / global_batch); returns the loss."""
    grad[:] = 0
    loss, _ = model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / cfg.global_batch, grad)
    return loss


def combine(grads: list[np.ndarray]) -> np.ndarray:
    """One gradient as it is; several summed left to right (the server's order, the replay's)."""
    total = grads[0].copy()
    for g in grads[1:]:
        total += g
    return total


def delay_of(acfg: AsyncConfig, worker: int, clock: int) -> float:
    """Seconds worker ``worker`` sleeps before computing ``clock`` (tests use it to vary interleavings)."""
    fixed = acfg.delays[worker - 1] if acfg.delays else 0.0
    if acfg.max_delay_s <= 0:
        return fixed
    return fixed + float(np.random.default_rng([acfg.delay_seed, worker, clock]).uniform(0, acfg.max_delay_s))


# -- the two roles -----------------------------------------------------------------------------

def train_async(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig = AsyncConfig()) -> AsyncResult:
    """Run on every rank: rank 0 serves the parameters, the others compute gradients."""
    acfg.validate(comm.world_size)
    cfg.validate()
    clocks = cfg.steps if acfg.clocks is None else acfg.clocks
    first = len(comm.tracer.events)
    if comm.rank == 0:
        params, log = serve(comm, cfg, acfg, clocks)
    else:
        params, log = work(comm, cfg, acfg, clocks), []
    events = list(comm.tracer.events[first:]) if comm.tracer.enabled else []
    return AsyncResult(params, log, events)


def work(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig, clocks: int) -> np.ndarray:
    """A worker's loop: pull, compute, push, once per clock."""
    model, data, initial = setup(cfg)
    me, workers, tr = comm.rank, comm.world_size - 1, comm.tracer
    params = initial  # replaced by every pull
    grad = comm.empty(model.num_params, initial.dtype)  # in shared memory: pushed without a copy
    header, reply = np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int64)  # reply: [version]
    for clock in range(clocks):
        t0 = tr.now()
        header[:] = (PULL, clock, -1)
        comm.send(header, 0, TAG_HEADER)
        comm.recv(reply, 0, TAG_REPLY)  # the server holds this back while the SSP gate is shut
        version, info = int(reply[0]), {"clock": clock, "version": int(reply[0])}
        t1 = tr.now()
        tr.record("wait", t0, t1, peer=0, extra=info)
        comm.recv(params, 0, TAG_PARAMS)
        tr.record("pull", t1, tr.now(), peer=0, bytes=params.nbytes, extra=info)
        with tr.span("compute", extra=info):
            time.sleep(delay_of(acfg, me, clock))
            compute_gradient(model, data, cfg, params, worker_batch(cfg, me, workers, clock), grad)
        with tr.span("push", peer=0, bytes=grad.nbytes, extra=info):
            header[:] = (PUSH, clock, version)
            comm.send(header, 0, TAG_HEADER)
            comm.send(grad, 0, TAG_GRAD)
    return params.copy()


def serve(comm: Communicator, cfg: TrainConfig, acfg: AsyncConfig,
          clocks: int) -> tuple[np.ndarray, list[LogEntry]]:
    """The server's loop: take pulls and pushes from any worker, in whatever order they come."""
    model, _, initial = setup(cfg)
    workers, tr = comm.world_size - 1, comm.tracer
    params = comm.empty(model.num_params, initial.dtype)
    params[:] = initial
    opt = make_optimizer(cfg.optimizer, model.num_params, params.dtype)
    grad = np.empty_like(initial)
    header, reply = np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int64)
    done = [0] * workers  # clocks finished (pushed, and applied) per worker
    version = 0  # updates applied so far
    waiting: list[tuple[int, int]] = []  # pulls (worker, clock) held at the gate, in arrival order
    answered: dict[tuple[int, int], tuple[int, int]] = {}  # (worker, clock) -> (version, slowest)
    held: dict[int, dict[int, np.ndarray]] = {}  # aggregate: clock -> worker -> gradient
    log: list[LogEntry] = []

    def answer(worker: int, clock: int) -> None:
        t0 = tr.now()
        answered[(worker, clock)] = (version, min(done))
        reply[0] = version
        comm.send(reply, worker, TAG_REPLY)
        comm.send(params, worker, TAG_PARAMS)
        tr.record("reply", t0, tr.now(), peer=worker, bytes=params.nbytes,
                  extra={"clock": clock, "version": version})

    def apply(pushes: list[tuple[int, int]], grads: list[np.ndarray]) -> None:
        nonlocal version
        t0 = tr.now()
        opt.step(params, combine(grads))
        version += 1
        t1 = tr.now()
        for worker, clock in pushes:
            v, slowest = answered.pop((worker, clock))
            log.append(LogEntry(worker, clock, v, version, slowest))
            tr.record("apply", t0, t1, peer=worker, extra={
                "staleness": version - 1 - v, "worker": worker, "clock": clock, "version": version})

    for _ in range(2 * workers * clocks):  # every worker sends one pull and one push per clock
        worker = comm.recv(header, ANY_SOURCE, TAG_HEADER)
        kind, clock, v = (int(x) for x in header)
        if kind == PULL:
            waiting.append((worker, clock))
        else:
            comm.recv(grad, worker, TAG_GRAD)
            if kind != PUSH or answered.get((worker, clock), (-1,))[0] != v:
                raise CommError(f"rank 0 got header {header.tolist()} from rank {worker} that matches "
                                "no answered pull: the workers speak another protocol")
            if not acfg.aggregate:
                apply([(worker, clock)], [grad])
            else:
                held.setdefault(clock, {})[worker] = grad.copy()
                if len(held[clock]) == workers:
                    ready = sorted(held.pop(clock).items())  # worker order: a fixed sum
                    apply([(w, clock) for w, _ in ready], [g for _, g in ready])
            done[worker - 1] += 1
        for w, c in [pull for pull in waiting if gate_open(done, pull[1], acfg.staleness)]:
            waiting.remove((w, c))
            answer(w, c)
    return np.array(params), log
