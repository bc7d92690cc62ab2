"""Running under an engine's own launcher: ``mpiexec -n 4 dplab ...``, ``torchrun ...`` or Slurm's
``srun``.

There the ranks already exist and this process is one of them: ``launch`` runs the function here, on
the launcher's communicator, and gathers every rank's result (a control-path pickle). A rank that
raises prints its traceback and aborts the job, so its peers fail fast. ``LauncherWorld`` keeps that
communicator for several runs (``dplab compare`` and ``bench``).

Each engine's launcher is one small class, found by backend in ``LAUNCHERS`` (``Mpiexec``,
``Torchrun``): which variables make this process a rank, its rank and the world's size, the ranks on
its host, how it joins the others, and how a rank that failed alone stops the job. Under ``srun``
each task of a step of several is a rank (``slurm_step``): MPI gets its world from Slurm's PMI
(``--mpi=pmi2`` or ``pmix``; without one each task would be a world of one: refused in one line),
torch from the step's variables (``slurm_torch_env``; MASTER_ADDR is the step's first node).
torchrun started by srun is torchrun.

Which ranks share a host (``Communicator.hosts``): ``launcher_hosts`` reads it from torchrun's or
Slurm's variables where they tell every rank's, else the ranks gather their node's name; MPI asks
MPI (``backends/mpi/comm.py``). ``spans_hosts`` says whether a job reaches past this host, which the
local backend's shared memory cannot.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["under_launcher", "launcher_env", "launcher_rank", "spans_hosts", "LauncherWorld",
           "run_here",
           "SlurmStep", "slurm_step", "slurm_torch_env", "expand_nodelist", "tasks_per_node",
           "launcher_hosts", "local_ranks", "Launcher", "LAUNCHERS", "torch_hosts"]

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PMI = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


# -- Slurm -----------------------------------------------------------------------------------------

def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``node[01-03,07],login1`` -> node01, node02,
    node03, node07, login1 (zero padding kept; several bracket groups multiply, as Slurm's do)."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        hosts += _expand_one(item)
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    values = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not (lo.isdigit() and (hi == "" or hi.isdigit())):
            raise ConfigError(f"Slurm node list {item!r}: {part!r} is not a number or a range "
                              "like 01-03")
        values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi or lo) + 1)]
    return [prefix + v + tail for v in values for tail in _expand_one(rest)]


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks per node, expanded: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"Slurm tasks per node {spec!r}: {part!r} is not N or N(xK)")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in an ``srun`` step: its rank among ``world_size`` tasks, among
    ``local_world_size`` on its node, the step's nodes in order (``nodes[0]`` holds rank 0)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    nodes: tuple[str, ...]
    job_id: int
    step_id: int
    # where the task sits, for the node layout
    # (``launcher_hosts``); left out of ==, which is about the rank
    node: int = field(default=0, compare=False)  # SLURM_NODEID: an index into ``nodes``
    counts: tuple[int, ...] = field(default=(), compare=False)  # tasks on each node of the step


def _first(env: Mapping[str, str], *keys: str) -> str | None:
    return next((env[k] for k in keys if env.get(k)), None)


def slurm_step(env: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This process as a task of an ``srun`` step of more than one task, or None (no Slurm, a batch
    script, a step of one task: then dplab starts its own ranks as anywhere else; a worker of a
    torchrun that srun started: torchrun's variables say its rank). The step's own
    variables (``SLURM_STEP_*``) win over the job's: ``srun -n 2`` inside an allocation of 8."""
    env = os.environ if env is None else env
    # a torchrun worker under srun: torchrun's rank, not the task's
    if all(k in env for k in _TORCHRUN):
        return None
    size = _first(env, "SLURM_STEP_NUM_TASKS")  # srun sets it; a batch script has only the job's
    rank, local = env.get("SLURM_PROCID"), env.get("SLURM_LOCALID")
    if not (size and rank and local and size.isdigit() and rank.isdigit() and local.isdigit()) \
            or int(size) < 2:
        return None
    nodes = tuple(expand_nodelist(_first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                         "SLURM_NODELIST")
                                  or ""))
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    node = int(env.get("SLURM_NODEID", "0") or 0)
    counts = tasks_per_node(per_node) if per_node else [int(size)]
    local_size = counts[node] if node < len(counts) else int(size)
    step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID") or "0"
    return SlurmStep(int(rank), int(size), int(local), local_size, nodes,
                     int(_first(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0),
                     int(step) if step.isdigit() else 0, node, tuple(counts))


def slurm_torch_env(step: SlurmStep, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed's env:// variables for a task of ``step``; any already set in ``env`` is
    kept. ``MASTER_PORT`` is the same on every task of a step and differs
    between the steps of a job."""
    env = os.environ if env is None else env
    if not step.nodes and "MASTER_ADDR" not in env:
        raise ConfigError("srun gave no node list (SLURM_STEP_NODELIST): export "
                          "MASTER_ADDR=<rank 0's host>")
    made = {"RANK": str(step.rank), "WORLD_SIZE": str(step.world_size),
            "LOCAL_RANK": str(step.local_rank),
            "LOCAL_WORLD_SIZE": str(step.local_world_size), "GROUP_RANK": str(step.node),
            "MASTER_ADDR": step.nodes[0] if step.nodes else "",
            "MASTER_PORT": str(20000 + (step.job_id * 64 + step.step_id) % 30000)}
    return {k: env.get(k) or v for k, v in made.items()}



class Launcher:
    """An engine's own launcher, whose ranks exist already: is this process one of them, its rank
    and the world's size, how many ranks share its host, and how it joins the others."""

    name = ""
    # (rank, world size) variables, in order of preference
    rank_keys: tuple[tuple[str, str], ...] = ()
    local_keys: tuple[tuple[str, str], ...] = ()  # (ranks on this host, ranks in all) variables

    def started(self, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def rank_and_size(self, env: Mapping[str, str]) -> tuple[int, int]:
        for rank, size in self.rank_keys:
            if rank in env and size in env:
                return int(env[rank]), int(env[size])
        step = slurm_step(env)
        if step is not None:
            return self.slurm_rank(step, env)
        raise ConfigError(f"not running under {self.name}")

    def slurm_rank(self, step: SlurmStep, env: Mapping[str, str]) -> tuple[int, int]:
        return step.rank, step.world_size

    def local_ranks(self, env: Mapping[str, str]) -> tuple[int, int] | None:
        for local, size in self.local_keys:
            if env.get(local, "").isdigit() and env.get(size, "").isdigit():
                return int(env[local]), int(env[size])
        step = slurm_step(env)
        return None if step is None else (step.local_world_size, step.world_size)

    def join(self, timeout: float) -> Any:
        raise NotImplementedError

    def abort(self, code: int) -> None:
        """This rank alone failed a check before joining: stop the job's other ranks, if they would
        wait for it for ever (torchrun stops them itself once one exits)."""


class Mpiexec(Launcher):
    """mpiexec (MPICH's hydra, Open MPI), or srun with PMI: MPI's own world, COMM_WORLD."""

    name = "mpiexec"
    rank_keys = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    local_keys = (("MPI_LOCALNRANKS", "PMI_SIZE"),
                  ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"))

    def started(self, env: Mapping[str, str]) -> bool:
        """A Slurm step without PMI counts too: ``rank_and_size`` says what is missing."""
        return "DPLAB_AUTHKEY" not in env and (
            any(k in env for k in _PMI) or slurm_step(env) is not None
        )

    def slurm_rank(self, step: SlurmStep, env: Mapping[str, str]) -> tuple[int, int]:
        """Under srun, MPI's world is the step's only through PMI (``--mpi=pmi2`` sets PMI_RANK and
        PMI_SIZE, read above; ``--mpi=pmix`` sets PMIX_RANK, and the step says the size)."""
        if "PMIX_RANK" in env:
            return step.rank, step.world_size
        raise ConfigError(f"srun started {step.world_size} tasks but gave MPI no PMI, so "
                          "each would be a world of one: run srun --mpi=pmi2 (or --mpi=pmix; srun "
                          "--mpi=list shows what this Slurm has)")

    def join(self, timeout: float) -> Any:
        """MPI asks MPI which ranks share a host when it connects
        (``MpiComm``: its shared-memory split)."""
        if slurm_step() is not None:
            # no PMI from srun: one line, before MPI_Init makes worlds of one
            self.rank_and_size(os.environ)
        from dplab.backends.mpi.comm import MpiComm

        return MpiComm.from_launcher(timeout)

    def abort(self, code: int) -> None:
        """The other ranks would wait for this one in MPI_Init for ever. MPICH's own "Abort(2) on
        node 0" line goes to /dev/null: ours was printed already."""
        from mpi4py import MPI

        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        MPI.COMM_WORLD.Abort(code)


class Torchrun(Launcher):
    """torchrun (env://), or srun without it: torch's variables made from Slurm's
    (``slurm_torch_env``)."""

    name = "torchrun"
    rank_keys = (("RANK", "WORLD_SIZE"),)
    local_keys = (("LOCAL_WORLD_SIZE", "WORLD_SIZE"),)

    def started(self, env: Mapping[str, str]) -> bool:
        return all(k in env for k in _TORCHRUN) or slurm_step(env) is not None

    def join(self, timeout: float) -> Any:
        step = slurm_step()
        if step is not None and not all(k in os.environ for k in _TORCHRUN):
            # srun without torchrun: env:// from Slurm's step
            os.environ.update(slurm_torch_env(step))
        from dplab.backends.torchdist.comm import TorchComm

        comm = TorchComm.from_launcher(timeout)
        comm.hosts = torch_hosts(comm)
        return comm


# backend -> its engine's launcher
LAUNCHERS: dict[str, Launcher] = {"mpi": Mpiexec(), "torch": Torchrun()}


def under_launcher(backend: str) -> bool:
    """True when this process is one rank of an ``mpiexec`` (mpi) or ``torchrun`` (torch) job.

    Args:
        backend: the backend's name; backends without a launcher give False.

    Returns:
        Whether the launcher's variables are in this process's environment.
    """
    launcher = LAUNCHERS.get(backend)
    return launcher is not None and launcher.started(os.environ)


def launcher_env(backend: str) -> tuple[int, int]:
    """(rank, world_size) that mpiexec, torchrun or srun gave this process.

    Args:
        backend: ``"mpi"`` or ``"torch"``.

    Returns:
        This process's rank and the job's world size, from the launcher's variables.

    Raises:
        ConfigError: ``backend`` has no launcher, or the launcher's variables are missing or
            malformed.
    """
    launcher = LAUNCHERS.get(backend)
    if launcher is None:
        raise ConfigError(f"not running under a {backend} launcher")
    return launcher.rank_and_size(os.environ)


def launcher_rank() -> int | None:
    """This process's rank in the job of whichever engine launcher started it, None outside one."""
    for launcher in LAUNCHERS.values():
        if launcher.started(os.environ):
            try:
                return launcher.rank_and_size(os.environ)[0]
            except ConfigError:  # srun without PMI: the error comes later, from rank 0 alone
                break
    step = slurm_step()
    return None if step is None else step.rank


def spans_hosts() -> str | None:
    """Why this process is one rank of a launcher job across several hosts (its launcher's own
    count of the ranks on this host), or None: one host, or no launcher."""
    env = os.environ
    for launcher in LAUNCHERS.values():
        for local, size in launcher.local_keys:
            here, ranks = env.get(local, ""), env.get(size, "")
            if here.isdigit() and ranks.isdigit() and int(here) < int(ranks):
                return f"this {launcher.name} job has {ranks} ranks, {here} of them on this host"
    step = slurm_step()
    if step is not None and step.local_world_size < step.world_size:
        return (f"this srun step has {step.world_size} ranks, {step.local_world_size} of them "
                "on this host")
    return None


def launcher_hosts(world_size: int, env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """Each rank's host index as this launcher's environment gives it for a world of ``world_size``,
    or None: no launcher, a world other than the launcher's, or a layout the environment does not
    tell (torchrun with another number of ranks on some host; Slurm's cyclic or arbitrary
    placement).

    torchrun numbers ranks host by host (group rank g holds ranks g L .. g L + L - 1 when every host
    runs L = LOCAL_WORLD_SIZE); a Slurm step with block placement
    gives node i the next counts[i]."""
    env = os.environ if env is None else env
    size, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if all(k in env for k in _TORCHRUN) and size.isdigit() and local.isdigit():
        w, n, rank = int(size), int(local), int(env["RANK"])
        group = env.get("GROUP_RANK", "")
        if w != world_size or n < 1 or w % n or (group.isdigit() and int(group) != rank // n):
            return None
        return tuple(r // n for r in range(w))
    step = slurm_step(env)
    if step is None or step.world_size != world_size or sum(step.counts) != world_size:
        return None
    if not env.get("SLURM_DISTRIBUTION", "block").startswith("block"):
        return None  # cyclic, plane or arbitrary: a node's tasks are not consecutive ranks
    return tuple(i for i, c in enumerate(step.counts) for _ in range(c))


def local_ranks(backend: str, env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(ranks on this host, ranks in all) from this process's launcher, or None outside one."""
    launcher = LAUNCHERS.get(backend)
    return None if launcher is None else launcher.local_ranks(os.environ if env is None else env)


def torch_hosts(comm: Any) -> tuple[int, ...]:
    """Each rank's host under torchrun or srun: from the environment where it tells every rank's
    (``launcher_hosts``), else every rank's GROUP_RANK (or SLURM_NODEID, or host name) gathered
    on the control path, once."""
    known = launcher_hosts(comm.world_size)
    if known is not None:
        return known
    env = os.environ
    mine = env.get("GROUP_RANK") or env.get("SLURM_NODEID") or socket.gethostname()
    names: dict[str, int] = {}
    return tuple(names.setdefault(str(k), len(names)) for k in comm.allgather_object(mine))


class LauncherWorld:
    """The launcher's ranks as a world: ``run(fn, *args)`` runs ``fn(comm, *args)`` here, on one
    communicator kept for the world's life, and returns every rank's result (as ``World.run``)."""

    def __init__(self, backend: str, timeout: float, world_size: int | None = None) -> None:
        self.backend, self.comm = backend, LAUNCHERS[backend].join(timeout)
        self.world_size = self.comm.world_size
        if world_size is not None and world_size != self.world_size:
            self._failed(ConfigError(f"the launcher started {self.world_size} ranks but "
                                     f"world_size is {world_size}: drop --world-size or make "
                                     "them agree"))

    def _failed(self, error: BaseException | None = None) -> None:
        """Say why on stderr and abort the job, so the peers fail fast instead of waiting."""
        detail = traceback.format_exc() if error is None else f"{type(error).__name__}: {error}\n"
        print(f"rank {self.comm.rank} failed:\n{detail}", file=sys.stderr, flush=True)
        # MPI_Abort / close: the peers fail fast, no hang
        getattr(self.comm, "abort", self.comm.close)()
        if error is not None:
            raise error

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        try:
            result = fn(self.comm, *args)
        except BaseException:
            self._failed()
            raise
        return self.comm.allgather_object(result)

    def close(self) -> None:
        self.comm.close()

    def __enter__(self) -> LauncherWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_here(fn: Callable, world_size: int | None, backend: str, args: tuple,
             timeout: float) -> list[Any]:
    """Run ``fn(comm, *args)`` on this launcher rank; every rank gets everyone's results."""
    with LauncherWorld(backend, timeout, world_size) as world:
        return world.run(fn, *args)
