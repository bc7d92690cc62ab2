"""A robust launch (issue 28, round 3): what a world needs is known before it starts, what its ranks
start ends with it, and what goes wrong in a rank is said in one line.

- a world larger than the machine can hold (processes, memory, semaphores, file descriptors) is
  refused before any rank starts, from the command line and from Python, on every backend;
- a process forked inside a rank ends with the world (closed, failed, or its launcher killed);
- ``launch`` inside a rank is refused in one line that says what to do;
- an MPI rank killed by SIGKILL is reported as such, without a traceback from its keeper.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dplab.backends.launch.world import RankError, World, check_backend, launch
from dplab.backends.local.shm import process_alive

ROOT = Path(__file__).resolve().parents[1]
ENGINES = [pytest.param("local", id="local"),
           pytest.param("torch", marks=pytest.mark.torch, id="torch"),
           pytest.param("mpi", marks=pytest.mark.mpi, id="mpi")]


def _available(backend: str) -> None:
    try:
        check_backend(backend)
    except Exception as e:  # BackendUnavailable: say what is missing
        pytest.skip(str(e))


def _all_gone(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still alive after ``within_s`` (SIGKILLed ones go at once; a loaded machine may
    take a moment to reap them); the survivors are killed here so that no test leaves them."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if process_alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    return alive


# -- a rank's children end with the world -----------------------------------------------------

def fork_sleeper(comm, fail: bool = False) -> int:
    """Start a child that would sleep for ten minutes; rank 1 then fails if asked."""
    child = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    if fail and comm.rank == 1:
        comm.barrier()  # every rank has forked its child before the failure
        raise RuntimeError(f"rank 1 fails, its child {child.pid} and rank 0's still running")
    if fail:
        comm.barrier()
    return child.pid


@pytest.mark.parametrize("backend", ENGINES)
def test_children_of_ranks_end_with_a_world_that_finished(backend):
    _available(backend)
    pids = launch(fork_sleeper, 2, backend=backend)
    assert len(set(pids)) == 2
    assert _all_gone(pids) == []


def _pids_in(detail: str) -> list[int]:
    return [int(w) for w in detail.replace(",", " ").split() if w.isdigit() and int(w) > 1]


@pytest.mark.parametrize("backend", ENGINES)
def test_children_of_ranks_end_with_a_world_that_failed(backend):
    _available(backend)
    with World(2, backend) as world:
        pids = world.run(fork_sleeper)  # a persistent world: the children of a finished job
        with pytest.raises(RankError, match="rank 1 fails"):
            world.run(fork_sleeper, True)
    assert _all_gone(pids) == []


LAUNCHER = """
import sys, time
from dplab.backends.launch.world import World
sys.path.insert(0, {tests!r})
from test_hardening_launch import fork_sleeper
with World(2) as world:
    print(*world.run(fork_sleeper), flush=True)
    time.sleep(600)
"""


def test_children_of_ranks_end_when_the_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(tests=str(ROOT / "tests"))],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    assert _all_gone(pids) == []  # the ranks' watch saw the launcher go and took their groups along


# -- launch inside a rank ----------------------------------------------------------------------

def nested_launch(comm) -> list:
    return launch(fork_sleeper, 2)


@pytest.mark.parametrize("backend", ENGINES)
def test_launch_inside_a_rank_is_refused_in_one_line(backend):
    _available(backend)
    with pytest.raises(RankError) as e:
        launch(nested_launch, 2, backend=backend)
    message = e.value.config_error()
    assert message is not None and "\n" not in message, e.value.detail
    assert "inside a rank" in message and "use the comm your function was given" in message


# -- an MPI rank killed by SIGKILL -------------------------------------------------------------

KILLED = """
import os, signal
from dplab.backends.launch.world import RankError, launch

def die(comm):
    if comm.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier()

if __name__ == "__main__":
    try:
        launch(die, 2, backend="mpi")
    except RankError as e:
        print(e)
"""


@pytest.mark.mpi
def test_an_mpi_rank_killed_by_sigkill_is_named_without_a_keeper_traceback(tmp_path):
    _available("mpi")
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "DPLAB_TIMEOUT": "10"})
    assert "rank 0 failed:\nprocess died from signal SIGKILL" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr and "Errno 22" not in done.stderr, done.stderr
