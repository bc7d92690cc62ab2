"""A collective, round by round, as the Collectives page shows it: pure data, no Streamlit.

    from dplab.viz.collectives import CollectiveConfig, walkthrough
    w = walkthrough(CollectiveConfig("allreduce", "ring", world_size=4, n=8))
    w.frames[2].sentence   # "round 3 of 6, reduce-scatter: rank 0 sends chunk 1 to rank 1, ..."
    w.frames[-1].holdings  # [rank, chunk, contributor]: every count 1, the simulator's provenance

Everything comes from the code that runs: the schedule is the one the executor runs
(``dplab.reference.collectives.schedule_plan``), the grid is the simulator's provenance
(``dplab.reference.simulate``), the values are the simulator run on small integer vectors one
round at a time, and the time is the cost model's walk of the rounds so far
(``dplab.reference.costmodel``). Frame k is the state before round k with round k's transfers;
the last frame is the end, so there are rounds + 1 frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dplab.reference.algorithms import ALLREDUCE
from dplab.reference.collectives import schedule_plan
from dplab.reference.costmodel import closed_form, cost
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import Schedule, Transfer, chunk_bounds
from dplab.reference.simulate import simulate
from dplab.viz.collectives_bytes import closed_form_bytes

__all__ = ["COLLECTIVES", "CollectiveConfig", "Frame", "Walkthrough", "algorithms_for",
           "schedule_for", "phases", "target", "contributors_label", "sentence",
           "closed_form_bytes", "walkthrough", "MAX_VALUES_N"]

# the collective's name in the executor -> in words
COLLECTIVES = {
    "allreduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "allgather": "all-gather",
    "broadcast": "broadcast",
    "reduce": "reduce",
}
MAX_VALUES_N = 256  # vectors up to this length are simulated with real values (shown on hover)
MAX_CLAUSES = 4  # a round's sentence names this many transfers, then counts the rest


@dataclass(frozen=True)
class CollectiveConfig:
    """What the page's controls pick. Costs: alpha in microseconds per message; beta and gamma as
    bandwidths in GB/s (beta = 1 / link bandwidth, gamma = 1 / reduction bandwidth), as the
    cost model reads them once converted to seconds per byte."""

    collective: str = "allreduce"
    algorithm: str = "ring"
    world_size: int = 4
    n: int = 8  # elements of the vector (float32: itemsize 4)
    alpha_us: float = 5.0
    beta_gbps: float = 10.0
    gamma_gbps: float = 20.0
    root: int = 0
    itemsize: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"collective must be one of {', '.join(COLLECTIVES)}, got "
                              f"{self.collective!r}")
        if not 1 <= self.world_size <= 64:
            raise ConfigError(f"world size must be 1..64, got {self.world_size}")
        if self.n < 0:
            raise ConfigError(f"vector length must be >= 0 elements, got {self.n}")
        if not 0 <= self.root < self.world_size:
            raise ConfigError(f"root must be a rank 0..{self.world_size - 1}, got {self.root}")
        for name in ("alpha_us", "beta_gbps", "gamma_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if self.algorithm not in algorithms_for(self.collective):
            raise ConfigError(f"{self.algorithm!r} has no {COLLECTIVES[self.collective]} schedule: "
                              f"choose one of {', '.join(algorithms_for(self.collective))}")

    @property
    def nbytes(self) -> int:
        return self.n * self.itemsize

    @property
    def abg(self) -> tuple[float, float, float]:
        """(alpha, beta, gamma) in seconds and seconds per byte."""
        return self.alpha_us * 1e-6, 1 / (self.beta_gbps * 1e9), 1 / (self.gamma_gbps * 1e9)


def algorithms_for(collective: str) -> list[str]:
    """Every algorithm that has a schedule for ``collective``:
    asked of the executor, not listed here."""
    found = []
    for name in ALLREDUCE:
        try:
            schedule_plan(collective, name, 2, 0)
        except ConfigError:
            continue
        found.append(name)
    return found


def schedule_for(cfg: CollectiveConfig) -> Schedule:
    """The very schedule the executor runs for this collective (``schedule_plan``)."""
    return schedule_plan(cfg.collective, cfg.algorithm, cfg.world_size, 0, cfg.root)[0]


def _phase_words(kind: str, algorithm: str) -> str:
    if kind == "reduce":
        return "reduce up the tree" if algorithm == "tree" else "reduce to the root"
    if kind == "broadcast":
        return "broadcast down the tree" if algorithm == "tree" else "broadcast from the root"
    return COLLECTIVES[kind]


def phases(cfg: CollectiveConfig, schedule: Schedule) -> list[str]:
    """The phase of every round. An all-reduce is two collectives run one after the other; which
    two is read off the executor's schedules, and checked against the all-reduce's own rounds."""
    if cfg.collective != "allreduce":
        return [_phase_words(cfg.collective, cfg.algorithm)] * len(schedule.rounds)
    p = cfg.world_size
    for first, second in (("reduce_scatter", "allgather"), ("reduce", "broadcast")):
        try:
            a = schedule_plan(first, cfg.algorithm, p, 0)[0]
            b = schedule_plan(second, cfg.algorithm, p, 0)[0]
        except ConfigError:
            continue
        if a.rounds + b.rounds == schedule.rounds:
            return ([_phase_words(first, cfg.algorithm)] * len(a.rounds)
                    + [_phase_words(second, cfg.algorithm)] * len(b.rounds))
    ops = {
        rnd: "reduce" if all(t.op == "reduce" for t in rnd) else "copy" for rnd in schedule.rounds
    }
    return ["reducing" if ops[rnd] == "reduce" else "copying" for rnd in schedule.rounds]


def target(cfg: CollectiveConfig, num_chunks: int) -> np.ndarray:
    """The provenance a finished collective must show, counts[rank, chunk, contributor]; -1 marks
    a cell the collective leaves as scratch (reduce-scatter's other chunks, reduce's non-roots)."""
    p = cfg.world_size
    want = np.full((p, num_chunks, p), -1, dtype=np.int64)
    if cfg.collective == "allreduce":
        want[:] = 1
    elif cfg.collective == "reduce_scatter":
        for r in range(p):
            want[r, r] = 1
    elif cfg.collective == "allgather":
        want[:] = 0
        for c in range(num_chunks):
            want[:, c, c] = 1
    elif cfg.collective == "broadcast":
        want[:] = 0
        want[:, :, cfg.root] = 1
    else:
        want[cfg.root] = 1
    return want


def _done(holding: np.ndarray, want: np.ndarray) -> np.ndarray:
    """[rank, chunk]: True where a cell with a target holds exactly it."""
    has_target = (want >= 0).all(axis=2)
    return has_target & (holding == want).all(axis=2)


def contributors_label(counts: np.ndarray) -> str:
    """Which ranks' contributions a cell holds, as ranges: '0-3', '0,2', '1×2' for one added
    twice."""
    parts: list[str] = []
    run: list[int] = []  # consecutive ranks, each held once

    def close() -> None:
        if run:
            parts.append(str(run[0]) if len(run) == 1 else ",".join(map(str, run)) if len(run) == 2
                         else f"{run[0]}-{run[-1]}")
            run.clear()

    for r in (int(r) for r in np.flatnonzero(counts)):
        if counts[r] > 1:
            close()
            parts.append(f"{r}×{int(counts[r])}")
        else:
            if run and r != run[-1] + 1:
                close()
            run.append(r)
    close()
    return ",".join(parts) if parts else "-"


def sentence(
    index: int, rounds: int, phase: str, transfers: tuple[Transfer, ...], num_chunks: int
) -> str:
    """One round in words: 'round 3 of 6, reduce-scatter: rank 0 sends chunk 2 to rank 1, which adds
    it'."""
    def clause(t: Transfer) -> str:
        what = "its whole buffer" if num_chunks == 1 else f"chunk {t.chunk}"
        verb = "adds" if t.op == "reduce" else "copies"
        return f"rank {t.src} sends {what} to rank {t.dst}, which {verb} it"
    said = "; ".join(clause(t) for t in transfers[:MAX_CLAUSES])
    if len(transfers) > MAX_CLAUSES:
        said += f"; and {len(transfers) - MAX_CLAUSES} more transfers like these, all at once"
    return f"round {index + 1} of {rounds}, {phase}: {said}"


@dataclass(frozen=True)
class Frame:
    """The state before round ``index`` (after the last round, for the final frame)."""

    index: int
    holdings: np.ndarray  # counts[rank, chunk, contributor], from the simulator
    values: list[np.ndarray] | None  # each rank's whole vector, or None for long vectors
    transfers: tuple[Transfer, ...]  # the round about to run; () in the final frame
    phase: str
    sentence: str
    bytes_sent: tuple[int, ...]  # per rank, over the rounds before this frame
    time_s: float  # cost-model time of the rounds before this frame
    done: np.ndarray  # [rank, chunk]: the cell already holds what the collective leaves there


@dataclass(frozen=True)
class Walkthrough:
    config: CollectiveConfig
    schedule: Schedule
    # each rank's starting vector (small integers); None past MAX_VALUES_N
    inputs: list[np.ndarray] | None
    frames: list[Frame]
    closed_form_bytes: int | None  # None: no textbook form (hierarchical with a smaller last node)
    # all-reduce only: the textbook time (tree: exact for powers of 2)
    closed_form_time_s: float | None
    correct: bool  # the final provenance is the collective's target
    final_values: list[np.ndarray] | None = field(default=None)  # simulate() on the whole schedule

    @property
    def rounds(self) -> int:
        return len(self.schedule.rounds)


def walkthrough(cfg: CollectiveConfig) -> Walkthrough:
    """Every frame of ``cfg``'s collective: provenance, values, words, bytes and time so far."""
    schedule = schedule_for(cfg)
    p, k, rounds = cfg.world_size, schedule.num_chunks, len(schedule.rounds)
    rng = np.random.default_rng(cfg.seed)
    # Only short vectors get values: a long one is priced by its length alone (``nbytes``), so a
    # billion elements cost nothing here instead of p copies of the vector.
    short = cfg.n <= MAX_VALUES_N
    inputs = [rng.integers(0, 10, cfg.n).astype(np.float32) for _ in range(p)] if short else None
    sim = simulate(schedule, inputs)
    values = [inputs] if inputs is not None else None
    for rnd in schedule.rounds if values is not None else ():  # the simulator, one round at a time
        values.append(simulate(Schedule(schedule.name, p, k, (rnd,)), values[-1]).buffers)
    names = phases(cfg, schedule)
    want = target(cfg, k)
    chunk_bytes = [(b - a) * cfg.itemsize for a, b in chunk_bounds(cfg.n, k)]
    alpha, beta, gamma = cfg.abg
    frames, sent = [], [0] * p
    for i in range(rounds + 1):
        transfers = schedule.rounds[i] if i < rounds else ()
        so_far = Schedule(schedule.name, p, k, schedule.rounds[:i])
        time_s = cost(so_far, cfg.nbytes, alpha, beta, gamma, cfg.itemsize).time
        words = (
            sentence(i, rounds, names[i], transfers, k)
            if i < rounds
            else _ending(
                cfg, rounds, bool((_done(sim.holdings[i], want) | (want < 0).all(2)).all())
            )
        )
        frames.append(Frame(i, sim.holdings[i], values[i] if values else None, transfers,
                            names[i] if i < rounds else "done", words, tuple(sent), time_s,
                            _done(sim.holdings[i], want)))
        for t in transfers:
            sent[t.src] += chunk_bytes[t.chunk]
    final_ok = bool((_done(sim.holdings[-1], want) | (want < 0).all(axis=2)).all())
    time_cf = None
    if cfg.collective == "allreduce":
        try:
            time_cf = closed_form(cfg.algorithm, p, cfg.nbytes, alpha, beta, gamma)
        except ValueError:
            # no textbook formula (the pipelined trees): the walk above is the model's time
            time_cf = None
    bytes_cf = closed_form_bytes(cfg.collective, cfg.algorithm, p, cfg.nbytes, cfg.itemsize)
    return Walkthrough(cfg, schedule, inputs, frames, bytes_cf, time_cf, final_ok, sim.buffers)


def _ending(cfg: CollectiveConfig, rounds: int, ok: bool) -> str:
    p = cfg.world_size
    if rounds == 0:
        return "no rounds: a single rank already holds the result"
    result = {
        "allreduce": f"every rank holds every chunk summed over all {p} ranks",
        "reduce_scatter": f"rank r holds chunk r summed over all {p} ranks",
        "allgather": "every rank holds every rank's chunk",
        "broadcast": f"every rank holds rank {cfg.root}'s vector",
        "reduce": f"rank {cfg.root} holds the sum of all {p} vectors",
    }[cfg.collective]
    verdict = "each contribution exactly once" if ok else "NOT what the collective must leave"
    return f"done after {rounds} round{'s' * (rounds != 1)}: {result}, {verdict}"
