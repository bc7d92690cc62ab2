"""Starting a world: timeouts read from the environment, MPI's start-up allowance, ``__main__`` on
MPI.

    pytest -q -p no:cacheprovider tests/test_launch_start.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_launch_procs import TESTS, descendants, gone, job_pid, mpich_segments, need, wait_until

from dplab.backends.launch.world import World, default_timeout, launch
from dplab.reference.errors import ConfigError

DPLAB = Path(sys.executable).parent / "dplab"
BAD_TIMEOUTS = ["abc", "0", "-1", "inf", "nan", "", "1e999"]


# -- 5. DPLAB_TIMEOUT ------------------------------------------------------------------------

@pytest.mark.parametrize("text", BAD_TIMEOUTS)
def test_launch_a_bad_dplab_timeout_is_one_config_error(monkeypatch, text):
    monkeypatch.setenv("DPLAB_TIMEOUT", text)
    for attempt in (default_timeout, lambda: World(2), lambda: launch(job_pid, 2)):
        with pytest.raises(ConfigError) as err:
            attempt()
        message = str(err.value)
        assert "\n" not in message and "DPLAB_TIMEOUT" in message and repr(text) in message
        assert "number of seconds > 0" in message


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_launch_a_bad_timeout_argument_is_a_config_error(value):
    with pytest.raises(ConfigError, match="timeout"):
        World(2, timeout=value)


def test_launch_good_dplab_timeouts_are_read(monkeypatch):
    for text, value in (("2.5", 2.5), (" 30 ", 30.0), ("1e3", 1000.0)):
        monkeypatch.setenv("DPLAB_TIMEOUT", text)
        assert default_timeout() == value
    monkeypatch.delenv("DPLAB_TIMEOUT")
    assert default_timeout() == 60.0


@pytest.mark.parametrize("text", ["abc", "nan", "0"])
def test_launch_dplab_train_with_a_bad_timeout_says_so_in_one_line(text):
    run = subprocess.run([str(DPLAB), "train", "--steps", "1"], capture_output=True, text=True,
                         env=dict(os.environ, DPLAB_TIMEOUT=text), timeout=60)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "DPLAB_TIMEOUT" in run.stderr, run.stderr


@pytest.mark.mpi
def test_launch_mpi_start_up_has_its_own_allowance(monkeypatch):
    """DPLAB_TIMEOUT=1 is for collectives: 8 MPI ranks on two cores still get the time to start."""
    need("mpi")
    monkeypatch.setenv("DPLAB_TIMEOUT", "1")
    t0 = time.monotonic()
    pids = launch(job_pid, 8, backend="mpi")
    print(f"8 MPI ranks started and answered in {time.monotonic() - t0:.2f}s with DPLAB_TIMEOUT=1")
    assert len(set(pids)) == 8


STALL = """
    import os, time
    if os.environ.get("PMI_RANK") == "1":  # rank 1 stalls after MPI_Init, before it connects
        import multiprocessing.connection as mc
        real = mc.Client
        def slow(*args, **kwargs):
            time.sleep(30)
            return real(*args, **kwargs)
        mc.Client = slow
"""

FAILED_START = """
    from dplab.backends import World
    from dplab.reference.errors import DplabError
    try:
        World(3, backend="mpi")
    except DplabError as e:
        print("start failed:", e, flush=True)
"""


@pytest.mark.mpi
def test_launch_a_failed_mpi_start_leaves_nothing_behind(tmp_path):
    """One rank never connects: within the allowance the start fails, with no process or segment
    left."""
    need("mpi")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(textwrap.dedent(STALL))
    (tmp_path / "launcher.py").write_text(textwrap.dedent(FAILED_START))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{TESTS}",
               DPLAB_TIMEOUT="3", DPLAB_START_TIMEOUT="12")  # 3 s: 0 of 3 beside a CPU hog
    proc = subprocess.Popen([sys.executable, "launcher.py"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    family: set[int] = set()
    mapped: set[str] = set()

    def watch() -> None:
        while proc.poll() is None:
            family.update(descendants(proc.pid))
            mapped.update(mpich_segments(family))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    proc.wait(60)
    elapsed = time.monotonic() - t0
    watcher.join()
    out = proc.stdout.read()
    assert "start failed:" in out and "2 of 3 MPI ranks connected" in out, (out, proc.stderr.read())
    assert "DPLAB_START_TIMEOUT" in out
    assert elapsed < 28, "the start waited for the stalled rank (30 s), not its allowance (12 s)"
    assert mapped, "rank 0 and 2 initialised MPI before the launcher gave up"
    assert wait_until(lambda: all(gone(p) for p in family), 5) < 5
    assert [m for m in mapped if Path(m).exists()] == []


# -- 8. functions of the user's script on MPI -----------------------------------------------

README = '''\
import numpy as np
from dplab.backends import allreduce, launch

def demo(comm):
    x = np.full(4, comm.rank + 1.0)
    allreduce(comm, x, algorithm="ring")
    return x

if __name__ == "__main__":
    print(launch(demo, 3))                  # 3 local ranks, each [6. 6. 6. 6.]
    print(launch(demo, 3, backend="mpi"))   # the same on MPI
'''

EXPECTED = "[array([6., 6., 6., 6.]), array([6., 6., 6., 6.]), array([6., 6., 6., 6.])]"


@pytest.mark.mpi
def test_launch_the_readme_example_runs_as_written_on_mpi(tmp_path):
    need("mpi")
    (tmp_path / "demo.py").write_text(README)
    run = subprocess.run([sys.executable, "demo.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [EXPECTED, EXPECTED], run.stdout


@pytest.mark.mpi
def test_launch_python_c_with_a_main_function_on_mpi_is_one_clear_error(tmp_path):
    need("mpi")
    code = README.replace('if __name__ == "__main__":\n', "if True:\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    assert run.stdout.splitlines() == [EXPECTED]  # the local launch runs
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("dplab.reference.errors.ConfigError:") and "module" in last, run.stderr
    assert "backend='local'" in last


@pytest.mark.mpi
def test_launch_an_unguarded_script_on_mpi_says_to_add_the_guard(tmp_path):
    """The rank runs the script as ``__mp_main__``: without the guard it would launch again."""
    need("mpi")
    (tmp_path / "bad.py").write_text(README.replace('if __name__ == "__main__":\n', "if True:\n")
                                     .replace("    print(launch(demo, 3))", "    pass"))
    run = subprocess.run([sys.executable, "bad.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    assert 'if __name__ == "__main__":' in run.stderr and "RankError" in run.stderr, run.stderr[
        -3000:
    ]
