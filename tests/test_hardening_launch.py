"""A robust launch (issue 28, round 3): what a world needs is known before it starts, what its ranks
start ends with it, and what goes wrong in a rank is said in one line.

- a world larger than the machine can hold (processes, memory, semaphores, file descriptors) is
  refused before any rank starts, from the command line and from Python, on every backend;
- a process forked inside a rank ends with the world (closed, failed, or its launcher killed);
- ``launch`` inside a rank is refused in one line that says what to do;
- an MPI rank killed by SIGKILL is reported as such, without a traceback from its keeper.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dplab.backends.launch import limits
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


# -- a world this machine cannot hold is refused before any rank starts ---------------------------

@pytest.mark.parametrize("argv, words", [
    (["--backend", "torch", "--world-size", "2000"], "a world of 2000 torch ranks"),
    (["--backend", "torch", "--world-size", "10000"], "a world of 10000 torch ranks"),
    (["--backend", "mpi", "--world-size", "10000"], "a world of 10000 mpi ranks"),
    (["--world-size", "100000"], "a world of 100000 local ranks"),
])
def test_a_world_too_large_for_this_machine_is_one_line_before_any_rank(cli_here, argv, words):
    _available(argv[1] if argv[0] == "--backend" else "local")
    done = cli_here("train", *argv, "--steps", "1")
    err = done.stderr.strip()
    assert done.returncode == 2 and "\n" not in err and words in err, err
    assert "use at most" in err


def _fake(**changes) -> limits.Machine:
    """This machine as it is now, with some limits set by hand."""
    return dataclasses.replace(limits.machine(), **changes)


def test_two_hundred_local_ranks_pass_no_default_map_count(monkeypatch):
    """The tester's numbers: 128 local ranks worked, 200 died 41 s in on ENOMEM from a semaphore
    (2p^2 of them, each a memory map in every rank). Under the default vm.max_map_count both are
    known before the fork."""
    here = _fake(max_maps=65530, maps=300, ram=None, shm=None, nofile=None, tasks=None)
    monkeypatch.setattr(limits, "machine", lambda: here)
    limits.check_world("local", 128)
    with pytest.raises(limits.WorldTooLarge) as e:
        limits.check_world("local", 200)
    assert re.search(r"200 local ranks needs 80,[0-9]{3} memory maps .* vm.max_map_count is "
                     r"65,530; use at most 1[3-9][0-9] ranks", str(e.value)), str(e.value)


@pytest.mark.parametrize("limit, words", [
    ({"nofile": 1024}, "open files in one process, but the limit is 1,024"),
    ({"tasks": 100}, "processes and threads, but only 100 more may run"),
    ({"shm": 64 << 20}, "of /dev/shm (the ranks' semaphores, mailboxes and staging buffers)"),
    ({"ram": 1 << 30}, "of memory (")])
def test_each_limit_refuses_in_one_line_with_the_largest_world_that_fits(monkeypatch, limit, words):
    here = _fake(**{"max_maps": None, "nofile": None, "tasks": None, "shm": None, "ram": None,
                    **limit})
    monkeypatch.setattr(limits, "machine", lambda: here)
    with pytest.raises(limits.WorldTooLarge, match=re.escape(words)) as e:
        limits.check_world("local", 4000)
    best = limits.largest_world("local", here, below=4000)
    assert f"use at most {best} rank" in str(e.value) and "\n" not in str(e.value)
    assert best >= 1 and limits.need("local", best, here).world_size == best
    limits.check_world("local", best)  # the largest that fits does, and one more does not
    with pytest.raises(limits.WorldTooLarge):
        limits.check_world("local", best + 1)


@pytest.mark.parametrize("backend", ["local", "torch", "mpi", "cuda"])
def test_what_a_world_needs_grows_with_its_size_on_every_backend(backend):
    here = limits.machine()
    small, large = limits.need(backend, 4, here), limits.need(backend, 400, here)
    for field in ("tasks", "ram", "fds"):
        assert getattr(large, field) > getattr(small, field) > 0, field
    assert large.maps >= small.maps and large.shm >= small.shm


def _one(comm) -> int:
    return comm.rank


@pytest.mark.parametrize("make", ["launch", "World"])
def test_the_python_api_refuses_a_world_too_large_before_it_forks(monkeypatch, make):
    from dplab.backends.launch import world as world_module

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(world_module, "start_ranks", no_ranks)
    here = _fake(nofile=1024, max_maps=None)
    monkeypatch.setattr(limits, "machine", lambda: here)
    with pytest.raises(limits.WorldTooLarge, match="open files in one process"):
        launch(_one, 5000) if make == "launch" else World(5000)
