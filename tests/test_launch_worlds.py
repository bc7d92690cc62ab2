"""Worlds that meet trouble: another user's stale segment, a thread that ends, a rank that dies or
exits.

    pytest -q -p no:cacheprovider tests/test_launch_worlds.py
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_launch_procs import (
    SHM,
    backend_param,
    gone,
    job_exit,
    job_pid,
    need,
    segments_of,
    wait_until,
)

from dplab.backends.launch.world import RankError, World, launch
from dplab.backends.local import shm

# -- 4. somebody else's stale segment --------------------------------------------------------
# The stale segment is named after pid 1, which is alive, so that no other launcher on this machine
# sweeps it while the test runs; the test alone is told that pid 1 is dead.

def test_launch_a_stale_segment_we_may_not_remove_is_skipped(monkeypatch):
    """Simulated: unlinking a stale segment raises PermissionError; the sweep goes on without it."""
    stale = SHM / f"{shm.PREFIX}1_0badc0de_ctl"
    stale.write_bytes(b"x")
    real_unlink, real_alive = Path.unlink, shm.process_alive

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == stale.name:
            raise PermissionError(13, "Operation not permitted", str(self))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(shm, "process_alive", lambda pid: pid != 1 and real_alive(pid))
    try:
        assert shm.sweep_stale() >= 0  # no PermissionError
        assert shm.unlink_prefix(stale.name) == 0
        assert len(launch(job_pid, 2)) == 2
        assert stale.exists()
    finally:
        monkeypatch.undo()
        stale.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user (uid 65534)")
def test_launch_another_users_stale_segment_does_not_block_a_launch():
    """Real: a root-owned stale segment in the sticky /dev/shm, a launcher running as uid 65534."""
    stale = SHM / f"{shm.PREFIX}1_0badc0de_ctl"
    stale.write_bytes(b"x")
    try:
        pid = os.fork()
        if pid == 0:  # the child: another user, launching as usual
            code = 3
            try:
                real_alive = shm.process_alive
                # "its launcher is dead"
                shm.process_alive = lambda pid: pid != 1 and real_alive(pid)
                os.setgid(65534)
                os.setuid(65534)
                code = 0 if launch(lambda comm: comm.rank, 2) == [0, 1] else 2
            except BaseException as e:  # noqa: BLE001 - report it through the exit code
                os.write(2, f"{type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert stale.exists()  # not ours to remove: skipped
        assert segments_of(pid) == []  # the other user's launch cleaned up after itself
    finally:
        stale.unlink(missing_ok=True)


# -- 6. a world made in a helper thread; a rank that died between runs -----------------------

@pytest.mark.parametrize("backend", [backend_param("local"), backend_param("torch")])
def test_launch_a_world_outlives_the_thread_that_made_it(backend):
    need(backend)
    made: list[World] = []
    maker = threading.Thread(target=lambda: made.append(World(2, backend, timeout=20.0)))
    maker.start()
    maker.join()
    with made[0] as world:
        first = world.run(job_pid)
        time.sleep(0.5)  # PR_SET_PDEATHSIG would have fired by now
        assert world.run(job_pid) == first and all(not gone(p) for p in first)


@pytest.mark.parametrize("backend", [backend_param("local"), backend_param("mpi"),
                                     backend_param("torch")])
def test_launch_run_on_a_world_with_a_dead_rank_names_it(backend):
    """The rank died between two runs: ``run`` raises RankError naming it, not BrokenPipeError."""
    need(backend)
    with World(3, backend, timeout=20.0) as world:
        pids = world.run(job_pid)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: gone(pids[1]), 5) < 5
        time.sleep(0.3)  # mpiexec stops the others; the world's pipes are broken
        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            world.run(job_pid)
        assert time.monotonic() - t0 < 10
        assert err.value.rank == 1 and "SIGKILL" in str(err.value), str(err.value)
        assert len(world.run(job_pid)) == 3  # and the world starts afresh


# -- 7. a rank that exits with a code --------------------------------------------------------

@pytest.mark.parametrize("backend", [backend_param("local"), backend_param("mpi")])
def test_launch_a_rank_that_exits_reports_its_exit_code(backend):
    need(backend)
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_exit, 3, backend=backend, args=(1, 3), timeout=20.0)
    assert time.monotonic() - t0 < 10
    assert err.value.rank == 1 and "exited with code 3" in str(err.value), str(err.value)
    assert type(err.value.rank) is int
