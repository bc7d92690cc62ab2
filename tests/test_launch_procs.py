"""Launching leaves nothing behind: no rank outlives its launcher, nothing stays in /dev/shm.

Each test runs a real launcher as a subprocess (a script calling ``launch``, or ``dplab train``),
ends it the way users do (interpreter exit, SIGKILL, SIGTERM), and then looks at the machine:
which of the launcher's descendants are still alive, which of its segments are still in /dev/shm.
The helpers here are shared by the other ``test_launch_*`` files.

    pytest -q -p no:cacheprovider tests/test_launch_procs.py
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.backends.local import shm

TESTS = Path(__file__).resolve().parent
SHM = Path("/dev/shm")


def backend_param(name: str, slow: bool = False):
    marks = [] if name == "local" else [getattr(pytest.mark, name)]
    return pytest.param(name, marks=marks + [pytest.mark.slow] * slow, id=name)


def need(backend: str) -> None:
    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))


# -- looking at processes and /dev/shm -------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def gone(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(int(stat.parent.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def mpich_segments(pids: set[int]) -> set[str]:
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names |= {line.split()[-1] for line in maps.splitlines() if "/dev/shm/mpich_shm_" in line}
    return {n.removesuffix(" (deleted)") for n in names}


def segments_of(launcher_pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"{shm.PREFIX}{launcher_pid}_*"))


def wait_until(predicate, timeout: float, step: float = 0.02) -> float:
    """Seconds until ``predicate()`` held; ``inf`` if it did not within ``timeout``."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return float("inf")
        time.sleep(step)


def slowdown() -> float:
    """How many times slower than on quiet cores CPU-bound work runs now: the 1-minute load per
    core, at least 1 (``lesson check``'s time limit scales the same way). A wall-clock bound on
    work that needs the CPU, such as an interpreter's exit, is the quiet bound times this."""
    return max(1.0, os.getloadavg()[0] / len(os.sched_getaffinity(0)))


def python_ranks(pids: set[int]) -> set[int]:
    """The descendants that are python interpreters (the ranks; mpiexec and its proxy are not)."""
    out = set()
    for pid in pids:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if "python" in Path(exe).name:
            out.add(pid)
    return out


def start(tmp_path: Path, code: str, *argv: str) -> subprocess.Popen:
    """Run ``code`` as a script in ``tmp_path`` (cwd outside the repository), in its own session."""
    script = tmp_path / "launcher.py"
    # Ctrl-C as a terminal's foreground job has it, even when pytest itself was started with SIGINT
    # ignored (a background job of a non-interactive shell): Python then installs no handler, and
    # the
    # script would never see its KeyboardInterrupt.
    script.write_text("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                      + textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(TESTS), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(script), *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_ranks(proc: subprocess.Popen, tmp_path: Path, n: int, timeout: float = 60) -> set[int]:
    """Block until ``n`` ranks wrote their ``rank*`` file; then the launcher's descendants."""
    waited = wait_until(lambda: len(list(tmp_path.glob("rank*"))) >= n or proc.poll() is not None,
                        timeout)
    if proc.poll() is not None or waited == float("inf"):
        reap(descendants(proc.pid) | {proc.pid})
        proc.wait(30)
        out, err = proc.stdout.read(), proc.stderr.read()
        raise AssertionError(f"the ranks did not start (rc {proc.returncode}):\n{out}\n{err}")
    time.sleep(0.3)  # everyone is in the busy loop now
    return descendants(proc.pid)


# -- what the ranks run ----------------------------------------------------------------------

KEEP: list = []


def job_spin(comm, record_dir: str) -> None:
    """Hold a buffer of the transport's memory and burn a core until killed."""
    KEEP.append(comm.empty(4096, "float64"))
    Path(record_dir, f"rank{comm.rank}").write_text(str(os.getpid()))
    x = 0
    while True:
        x = (x + sum(range(1000))) % 7


def job_hold(comm, record_dir: str) -> int:
    """Keep a buffer alive in this rank after the call returns, and say who we are."""
    KEEP.append(comm.empty(4096, "float64"))
    Path(record_dir, f"rank{comm.rank}").write_text(str(os.getpid()))
    return os.getpid()


def job_pid(comm) -> int:
    return os.getpid()


def job_exit(comm, rank: int, code: int) -> int:
    if comm.rank == rank:
        os._exit(code)
    comm.barrier()  # the others wait for the one that exits: a lost peer, not an early finish
    return comm.rank


# -- 1. an unclosed World --------------------------------------------------------------------

UNCLOSED = """
    import sys
    from dplab.backends import World
    from test_launch_procs import job_hold
    w = World(2, backend=sys.argv[1])
    print(w.run(job_hold, sys.argv[2]), flush=True)
"""


# slow: torch's ranks import torch (~8 CPU-s); local's and mpi's exits are the two that differ
@pytest.mark.parametrize("backend", [backend_param("local"), backend_param("mpi"),
                                     backend_param("torch", slow=True)])
def test_launch_an_unclosed_world_leaves_nothing_after_exit(tmp_path, backend):
    """``w = World(2)`` and the interpreter ends: no rank, no segment, no MPICH memory survives."""
    need(backend)
    proc = start(tmp_path, UNCLOSED, backend, str(tmp_path))
    family: set[int] = set()
    mapped: set[str] = set()

    def watch() -> None:  # what the ranks map, read while they are alive
        while proc.poll() is None:
            family.update(descendants(proc.pid))
            mapped.update(mpich_segments(family))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=60)
    watcher.join()
    assert proc.returncode == 0, err
    ranks = {int(f.read_text()) for f in tmp_path.glob("rank*")}
    assert len(ranks) == 2 and sorted(ast.literal_eval(out)) == sorted(ranks)
    waited = wait_until(lambda: all(gone(p) for p in family | ranks), 5)
    assert waited < 5, [p for p in family | ranks if not gone(p)]
    assert segments_of(proc.pid) == []
    assert [m for m in mapped if Path(m).exists()] == []


# -- 2. a launcher that is killed ------------------------------------------------------------

SPIN = """
    import sys
    from dplab.backends import launch
    from test_launch_procs import job_spin
    launch(job_spin, 2, backend=sys.argv[1], args=(sys.argv[2],))
"""


def _kill_and_watch(proc: subprocess.Popen, family: set[int], sig: int) -> tuple[float, set[str]]:
    """Signal the launcher alone; seconds until every descendant is gone, and MPICH's leftovers."""
    mapped = mpich_segments(family)
    assert mapped or not any("mpiexec" in _cmd(p) for p in family)
    os.kill(proc.pid, sig)
    proc.wait(30)  # not communicate(): a surviving mpiexec would hold the pipes open
    try:
        waited = wait_until(lambda: all(gone(p) for p in family), 10)
        for pid in (p for p in family if not gone(p)):  # before reap: what each was stuck in
            print(f"outlived its launcher: {pid} {_where(pid)}")
    finally:
        reap(family)
    return waited, {m for m in mapped if Path(m).exists()}


def reap(pids: set[int]) -> None:
    """SIGKILL what a failed test left running, so that it does not burn the other tests' cores."""
    for pid in pids:
        if not gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _where(pid: int) -> str:
    """A survivor's command, state, kernel wait and system call, and its children's states (what it
    was stuck in, when it outlived: a zombie child it never reaped says it stopped reading)."""
    state = (_stat(pid) or ["gone"])[0]
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        syscall = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        wchan = syscall = "gone"
    kids = [(child, (_stat(child) or ["gone"])[0]) for child in descendants(pid)]
    return (f"{_cmd(pid)[:120]!r} state {state} waiting in {wchan} (system call {syscall}), "
            f"descendants {kids}")


# slow: mpi-SIGTERM (mpi's SIGKILL and local's SIGTERM cover it) and torch-SIGKILL (local's path;
# its ranks import torch): one case per launcher and per signal runs by default
@pytest.mark.parametrize("backend, sig", [
    pytest.param(b, s, marks=([] if b == "local" else [getattr(pytest.mark, b)])
                 + ([pytest.mark.slow] if slow else []), id=f"{b}-{s.name}")
    for b, s, slow in [("local", signal.SIGKILL, False), ("local", signal.SIGTERM, False),
                       ("mpi", signal.SIGKILL, False), ("mpi", signal.SIGTERM, True),
                       ("torch", signal.SIGKILL, True)]])
def test_launch_ranks_die_with_a_killed_launcher(tmp_path, backend, sig):
    """SIGKILL/SIGTERM to a script in ``launch``: every rank (mpiexec, its proxy) gone within
    seconds."""
    need(backend)
    proc = start(tmp_path, SPIN, backend, str(tmp_path))
    family = wait_for_ranks(proc, tmp_path, 2)
    assert len(python_ranks(family)) >= 2
    waited, leaked = _kill_and_watch(proc, family, sig)
    print(f"{backend} {sig.name}: every rank gone {waited:.2f}s after the launcher died")
    assert waited < 5, [(p, _cmd(p)) for p in family if not gone(p)]
    assert segments_of(proc.pid) == [] and leaked == set()


@pytest.mark.mpi
def test_launch_dplab_train_on_mpi_dies_with_its_launcher(tmp_path):
    """The reported case: ``dplab train --backend mpi --steps 1000000``, launcher SIGKILLed."""
    need("mpi")
    dplab = Path(sys.executable).parent / "dplab"
    proc = subprocess.Popen([str(dplab), "train", "--backend", "mpi", "--world-size", "2",
                             "--steps", "1000000"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ready = wait_until(lambda: len(mpich_segments(python_ranks(descendants(proc.pid)))) > 0, 60)
    assert ready < 60
    time.sleep(1.0)  # training now
    family = descendants(proc.pid)
    waited, leaked = _kill_and_watch(proc, family, signal.SIGKILL)
    print(f"dplab train mpi SIGKILL: every rank gone {waited:.2f}s after the launcher died")
    assert waited < 5, [(p, _cmd(p)) for p in family if not gone(p)]
    assert leaked == set()
