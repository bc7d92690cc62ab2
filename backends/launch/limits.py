"""What a world of p ranks takes from this machine, checked before the first rank starts.

    check_world("local", 200)   # WorldTooLarge: 80,000 memory maps per process, vm.max_map_count ..
    need("torch", 8)            # WorldNeed: processes, threads, memory, /dev/shm, maps, descriptors
    machine()                   # Machine: what this machine and this process may still take

Every backend's ranks cost processes (or threads), private memory, file descriptors and, on the
local backend, two semaphores per ordered pair of ranks, each a memory map in *every* process of
the world (multiprocessing maps each named semaphore): 2p^2 of them grow past ``vm.max_map_count``
(65,530 by default) near p = 180, where the kernel answers a semaphore with ENOMEM. A world too
large for any of these fails late and noisily (a rank's traceback, or hundreds); here it is one
line that names the limit and the largest world that fits. ``extra`` adds what the ranks' job
holds (a training run's arrays: ``dplab.backends.runs.memory``).

What one rank costs (``COSTS``) was measured with ``/proc/<pid>/smaps_rollup`` on the ranks of a
short ``dplab train`` (private memory after the run: local 8 MiB, torch 12 MiB, an MPI rank 27 MiB
and its keeper 4 MiB) and is taken at about twice that; descriptors and maps were counted in
``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` at p = 4 and 8. A backend this table does not know
costs what the backends that start their ranks the same way cost.
"""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dplab.backends.registry import entry
from dplab.reference.errors import ConfigError
from dplab.reference.files import size_text

__all__ = ["RankCost", "COSTS", "WorldNeed", "Machine", "WorldTooLarge", "need", "machine",
           "check_world", "largest_world", "mem_available_bytes"]

MiB = 1 << 20


@dataclass(frozen=True)
class RankCost:
    """What one rank of a backend costs, and what its world costs once."""

    ram: int  # private memory of one rank: its process (and keeper), or its thread's share
    processes: float  # processes per rank (MPI: the rank and its keeper; threads: none of its own)
    threads: int  # threads per rank, its processes' included
    fds: int  # descriptors a rank opens itself, beyond what it inherits
    fds_per_peer: int  # ... per rank of the world (gloo's sockets, pipes of ranks forked before it)
    launcher_fds: int  # descriptors per rank in the launcher (or in mpiexec's proxy)
    maps_per_pair: int = 0  # memory maps per ordered pair of ranks, in every process of the world
    maps_per_rank: int = 0  # ... per rank, in every process of the world
    maps: int = 0  # maps a rank makes for itself (its segments and the peers' it keeps)
    shm: int = 0  # bytes of /dev/shm per rank
    shm_per_pair: int = 0  # ... per ordered pair of ranks
    world_processes: int = 0  # processes per world besides the ranks (mpiexec, its proxy)
    world_ram: int = 0  # private memory of those
    shm_what: str = "its shared memory"  # what the /dev/shm is for, in words ({p}: the world size)
    maps_what: str = ""  # why its maps grow with the ranks, in words


COSTS: dict[str, RankCost] = {
    # semaphores ready/done per pair, arrival per rank: a 4 KiB page of /dev/shm and a map each;
    # the control segment: 64 descriptors of 40 bytes per pair; a rank maps its own segments and
    # PEER_CACHE (32) of its peers', and malloc maps each large array on its own
    # a 1 MiB staging segment each rank makes for what it sends from outside /dev/shm
    "local": RankCost(16 * MiB, 1, 3, 32, 3, 3, maps_per_pair=2, maps_per_rank=1, maps=256,
                      shm=4096 + MiB, shm_per_pair=2 * 4096 + 2560,
                      shm_what="the ranks' semaphores, mailboxes and staging buffers",
                      maps_what="two semaphores per pair of ranks, each mapped in every rank"),
    "torch": RankCost(32 * MiB, 1, 8, 40, 5, 3),
    "mpi": RankCost(64 * MiB, 2, 6, 40, 2, 5, shm=1100 * 1024, world_processes=2,
                    world_ram=32 * MiB,  # the rank and its keeper; mpiexec and its proxy
                    shm_what="MPICH's shared memory of {p} ranks"),
    "cuda": RankCost(4 * MiB, 0, 2, 2, 0, 2, world_processes=1, world_ram=512 * MiB),
}
_BY_START = {"fork": "torch", "threads": "cuda", "mpiexec": "mpi"}  # a backend not in COSTS


def _cost(backend: str) -> RankCost:
    """``backend``'s costs; a backend not in COSTS costs what one that
    starts its ranks alike does."""
    return COSTS.get(backend) or COSTS[_BY_START.get(entry(backend).start, "torch")]

@dataclass(frozen=True)
class WorldNeed:
    """What a world of ``world_size`` ranks of ``backend`` takes, its job's arrays included."""

    backend: str
    world_size: int
    tasks: int  # processes and threads it starts
    ram: int  # bytes of memory (its /dev/shm included: tmpfs lives in memory)
    shm: int  # bytes of /dev/shm
    maps: int  # memory maps of its busiest process
    fds: int  # descriptors of its busiest process
    extra_ram: int = 0  # of ``ram``: what the job's arrays hold
    extra_shm: int = 0  # of ``shm``: what the job's arrays hold
    extra_what: str = ""  # those arrays in words
    shm_what: str = ""  # what its /dev/shm is for, in words


@dataclass(frozen=True)
class Machine:
    """What this machine, and this process, can still give a world (None: no limit known)."""

    ram: int | None  # MemAvailable, or less within this process's memory cgroup
    shm: int | None  # free bytes of /dev/shm
    nofile: int | None  # RLIMIT_NOFILE (soft): descriptors per process
    open_fds: int  # descriptors this process holds now: forked ranks inherit them
    max_maps: int | None  # vm.max_map_count: memory maps per process
    maps: int  # maps this process has now: forked ranks inherit them
    tasks: int | None  # processes and threads that can still start (pid_max, threads-max, ...)


class WorldTooLarge(ConfigError):
    """A world this machine cannot hold; the message names the limit and the largest that fits."""


Extra = Callable[[int], tuple[int, int, str]]  # world size -> (bytes of memory, of /dev/shm, words)


def need(backend: str, world_size: int, here: Machine | None = None, extra: Extra | None = None
         ) -> WorldNeed:
    """What a world of ``world_size`` ranks of ``backend`` takes (``here``: the launcher's state,
    which forked ranks inherit; ``extra``: the job's arrays at this world size)."""
    here = here or machine()
    found, c = entry(backend), _cost(backend)
    p = world_size
    # forked ranks inherit the launcher's descriptors and maps; a fresh interpreter has its own
    inherited_fds, inherited_maps = (here.open_fds, here.maps) if found.forked else (0, 512)
    shm = p * c.shm + p * p * c.shm_per_pair
    extra_ram, extra_shm, words = extra(p) if extra is not None else (0, 0, "")
    return WorldNeed(
        backend, p,
        tasks=int(p * c.processes + c.world_processes) + p * c.threads,
        ram=p * c.ram + c.world_ram + shm + extra_ram + extra_shm,
        shm=shm + extra_shm,
        maps=inherited_maps + p * p * c.maps_per_pair + p * c.maps_per_rank + c.maps,
        fds=max(here.open_fds + p * c.launcher_fds, inherited_fds + c.fds + p * c.fds_per_peer),
        extra_ram=extra_ram + extra_shm, extra_shm=extra_shm, extra_what=words,
        shm_what=c.shm_what.format(p=p)
        + (f", and {size_text(extra_shm)} of the job's arrays" if extra_shm else ""))


def _fits(n: WorldNeed, here: Machine) -> tuple[str, str, bool] | None:
    """(why ``n`` does not fit ``here``, by how much; what else than fewer ranks would help; whether
    a smaller job would), or None when it fits."""
    what = f"a world of {n.world_size} {n.backend} ranks"
    if here.max_maps is not None and n.maps > here.max_maps:
        maps_what = _cost(n.backend).maps_what
        why = f" ({maps_what})" if maps_what else ""
        return (f"{what} needs {n.maps:,} memory maps per process{why}, but vm.max_map_count is "
                f"{here.max_maps:,}", "raise vm.max_map_count (sysctl -w vm.max_map_count=...)",
                False)
    if here.nofile is not None and n.fds > here.nofile:
        return (f"{what} needs {n.fds:,} open files in one process, but the limit is "
                f"{here.nofile:,}", "raise the limit (ulimit -n)", False)
    if here.tasks is not None and n.tasks > here.tasks:
        return (f"{what} starts {n.tasks:,} processes and threads, but only {here.tasks:,} "
                "more may run", "end other processes", False)
    if here.shm is not None and n.shm > here.shm:
        return (f"{what} needs {size_text(n.shm)} of /dev/shm ({n.shm_what}), but "
                f"{size_text(here.shm)} is free: {size_text(n.shm - here.shm)} too much",
                "free /dev/shm (df -h /dev/shm) or enlarge it (mount -o remount,size=... /dev/shm)",
                2 * n.extra_shm > n.shm)  # a smaller job helps where its arrays are most of it
    if here.ram is not None and n.ram > here.ram:
        parts = f"{size_text(n.ram - n.extra_ram)} for the ranks"
        if n.extra_ram:
            parts += f", {size_text(n.extra_ram)} for {n.extra_what or 'their arrays'}"
        return (f"{what} needs {size_text(n.ram)} of memory ({parts}), but {size_text(here.ram)} "
                f"is available: {size_text(n.ram - here.ram)} too much", "",
                2 * n.extra_ram > n.ram)
    return None


def largest_world(backend: str, here: Machine, extra: Extra | None = None,
                  below: int = 1 << 20) -> int:
    """The largest world size under ``below`` that fits ``here`` (0: not even one rank)."""
    lo, hi = 0, below
    while lo + 1 < hi:  # every need grows with p: bisect
        mid = (lo + hi) // 2
        if _fits(need(backend, mid, here, extra), here) is None:
            lo = mid
        else:
            hi = mid
    return lo


def check_world(backend: str, world_size: int, extra: Extra | None = None,
                fix: str = "") -> WorldNeed:
    """Refuse, in one line, a world this machine cannot hold; returns what it needs.

    Args:
        backend: a registered backend's name.
        world_size: ranks to start.
        extra: the job's arrays as a function of the world size (see ``Extra``), if any.
        fix: what else the user can change for the job (e.g. "use a smaller --hidden").

    Raises:
        WorldTooLarge: which limit the world exceeds, by how much, and the largest world that fits.
    """
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    here = machine()
    n = need(backend, world_size, here, extra)
    found = _fits(n, here)
    if found is None:
        return n
    why, remedy, job = found
    best = largest_world(backend, here, extra, below=world_size)
    ways = [w for w in (fix if job else "", remedy) if w]
    if best:
        ways.insert(0, f"use at most {best} rank{'s' if best > 1 else ''}")
        raise WorldTooLarge(f"{why}; {', or '.join(ways)}")
    ways_text = f": {', or '.join(ways)}" if ways else ""
    raise WorldTooLarge(f"{why}; not even one rank fits{ways_text}")


# -- this machine ----------------------------------------------------------------------------------

def machine() -> Machine:
    """What this machine and this process can still give a world, read now."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return Machine(ram=mem_available_bytes(), shm=_shm_free(),
                   nofile=None if nofile == resource.RLIM_INFINITY else nofile,
                   open_fds=_lines("/proc/self/fd"),
                   max_maps=_read_int("/proc/sys/vm/max_map_count"),
                   maps=_lines("/proc/self/maps"), tasks=_tasks_left())


def mem_available_bytes() -> int | None:
    """MemAvailable (/proc/meminfo), or what this process's memory cgroup still allows if less;
    None where neither can be read."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = _cgroup_room(("memory.max", "memory.current"),
                        ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))
    return room if found is None or (room is not None and room < found) else found


def _shm_free() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def _tasks_left() -> int | None:
    """Processes and threads that may still start: the kernel's pid_max and threads-max less what
    runs, the pids cgroup, and RLIMIT_NPROC for a user other than root (which it does not bind)."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None
    room = [top - running for top in (_read_int("/proc/sys/kernel/pid_max"),
                                      _read_int("/proc/sys/kernel/threads-max")) if top]
    cgroup = _cgroup_room(("pids.max", "pids.current"), ("pids", "pids.max", "pids.current"))
    room += [cgroup] if cgroup is not None else []
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.geteuid() != 0 and nproc != resource.RLIM_INFINITY:
        room.append(nproc - _user_tasks())
    return min(room) if room else None


def _user_tasks() -> int:
    """Threads of this user's processes: what RLIMIT_NPROC counts."""
    uid, n = str(os.getuid()), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text().splitlines()
            lines = dict(line.split(":", 1) for line in text if ":" in line)
        except OSError:
            continue
        if lines.get("Uid", "").split()[:1] == [uid]:
            n += int(lines.get("Threads", "1"))
    return n


def _cgroup_room(v2: tuple[str, str], v1: tuple[str, str, str]) -> int | None:
    """limit - usage of this process's cgroup (v2, else the v1 controller's); None: no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            dirs, names = [Path("/sys/fs/cgroup") / path.lstrip("/"), Path("/sys/fs/cgroup")], v2
        elif v1[0] in controllers.split(","):
            base = Path("/sys/fs/cgroup") / v1[0]
            dirs, names = [base / path.lstrip("/"), base], v1[1:]
        else:
            continue
        for d in dirs:
            limit, usage = _read_int(d / names[0]), _read_int(d / names[1])
            if limit is not None and usage is not None:
                return limit - usage if limit < 1 << 60 else None
    return None


def _read_int(path: str | Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _lines(path: str) -> int:
    """Entries of a /proc directory, or lines of a /proc file (0 where there is none)."""
    try:
        if os.path.isdir(path):
            return len(os.listdir(path))
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0

