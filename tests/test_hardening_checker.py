"""``dplab lesson check`` against settings, processes, output and counts it does not expect.

A bad ``$DPLAB_CHECK_*`` or a missing folder is one line and exit 2 (never a verdict on the
learner); a grandchild that leaves the session dies with the check; a learner that SIGSTOPs its
checker's process (or its parent) gets a verdict, not a hung ``dplab``; escape sequences it
prints or raises are shown as text; the bytes ZeRO-2 and FSDP send are counted where the
learner's code cannot reset them; and SSP's run names the same worker at any load.

    pytest -q tests/test_hardening_checker.py
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

from dplab.lessons.exercises import SOLUTIONS, check_file, child, ssp
from dplab.lessons.exercises.learner import CheckUnavailable
from dplab.reference.ps.protocol import AsyncConfig

DPLAB = [sys.executable, "-m", "dplab.backends.cli", "lesson"]
GATE = ("def may_proceed(clock, slowest, staleness):\n"
        "    return staleness is None or slowest >= clock - staleness\n")


def _write(folder: Path, name: str, source: str) -> Path:
    file = folder / f"{name}.py"
    file.write_text(textwrap.dedent(source))
    return file


def _lesson(*words: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DPLAB, *words], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "300", **(env or {})})


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# --- settings and folders: the machine's, one line, exit 2 -----------------------------------

MIB_FROM_256 = "must be a whole number of MiB from 256"
BAD_SETTINGS = [
    ("DPLAB_CHECK_MEMORY_MB", "99999999999999",
     f"DPLAB_CHECK_MEMORY_MB='99999999999999' {MIB_FROM_256} to "),
    ("DPLAB_CHECK_MEMORY_MB", "12", f"DPLAB_CHECK_MEMORY_MB='12' {MIB_FROM_256}"),
    ("DPLAB_CHECK_MEMORY_MB", "4G", f"DPLAB_CHECK_MEMORY_MB='4G' {MIB_FROM_256}"),
    ("DPLAB_CHECK_LIMIT_S", "inf", "DPLAB_CHECK_LIMIT_S='inf' must be a positive number of"),
    ("DPLAB_CHECK_LIMIT_S", "soon", "DPLAB_CHECK_LIMIT_S='soon' is not a number of seconds"),
    ("DPLAB_CHECK_MEMORY", "512", "DPLAB_CHECK_MEMORY is not a setting of dplab lesson check: the "
                                  "settings are DPLAB_CHECK_LIMIT_S and DPLAB_CHECK_MEMORY_MB"),
]


def _refused(proc: subprocess.CompletedProcess, says: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "", proc.stdout  # no verdict, no header: the setting, not the learner
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dplab lesson: error: {says}"), proc.stderr


@pytest.mark.parametrize("name, value, says", BAD_SETTINGS,
                         ids=[f"{n}={v}" for n, v, _ in BAD_SETTINGS])
def test_a_bad_check_setting_is_one_line_and_exit_2_before_any_child(tmp_path, monkeypatch,
                                                                     cli_here, name, value, says):
    """In this process (``cli_here``), with the check's child process refused outright: two
    interpreters a setting cost 2 CPU-s; the test below runs one setting as a real process."""
    def no_child(*args: object) -> None:
        raise AssertionError("a check's child started: the setting must be refused before")

    (tmp_path / "ssp_gate.py").write_text(GATE)
    for key in [k for k in os.environ if k.startswith("DPLAB_CHECK_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(child, "_run_child", no_child)
    for action in ("check", "watch"):
        _refused(cli_here("lesson", action, "7", str(tmp_path)), says)


def test_a_bad_check_setting_in_a_real_process_is_one_line_and_exit_2(tmp_path):
    name, value, says = BAD_SETTINGS[0]
    (tmp_path / "ssp_gate.py").write_text(GATE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPLAB_CHECK_")}
    for action in ("check", "watch"):
        _refused(subprocess.run([*DPLAB, action, "7", str(tmp_path)], capture_output=True,
                                text=True, timeout=120, env={**env, name: value}), says)


def test_a_child_that_cannot_set_its_limit_is_the_machines_not_the_learners(tmp_path, monkeypatch):
    # settings that passed the parent's check, but that the child's setrlimit refuses anyway
    monkeypatch.setattr(child, "check_settings", lambda: (5.0, 1 << 50))
    with pytest.raises(CheckUnavailable, match=r"cannot check ssp_gate.py on this machine: the "
                                               r"check's process could not set up \(OverflowError"):
        check_file("ssp_gate", _write(tmp_path, "ssp_gate", GATE))


def test_the_default_time_limit_stretches_with_the_load_and_a_set_one_does_not(monkeypatch):
    """A right answer beside a busy machine is not a loop that never ends: the suite once saw
    the DDP-hooks solution (4 s quiet) pass its 30 s at a load of 36 on 2 cores."""
    import os

    from dplab.lessons.exercises import learner

    monkeypatch.delenv("DPLAB_CHECK_LIMIT_S", raising=False)
    monkeypatch.setattr("dplab.viz.budget.cores", lambda: 2)
    for load, limit in ((0.3, 30), (2.0, 30), (6.0, 90), (36.0, 540), (500.0, 600)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert learner.limit_s() == limit
    monkeypatch.setenv("DPLAB_CHECK_LIMIT_S", "2")  # asked for: as asked, whatever the load
    assert learner.limit_s() == 2


def test_check_on_a_missing_folder_exits_2_as_watch_does(tmp_path):
    missing = tmp_path / "nowhere"
    for action in ("check", "watch"):
        proc = _lesson(action, "7", str(missing))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr == (f"dplab lesson: error: {missing} is not a folder: dplab lesson init "
                               f"{missing} copies the exercises there\n")


# --- processes ------------------------------------------------------------------------------

def test_a_grandchild_that_left_the_session_dies_with_the_check(tmp_path):
    pid_file = tmp_path / "pid"
    file = _write(tmp_path, "ssp_gate", f"""
        import os, time
        def may_proceed(clock, slowest, staleness):
            if (clock, slowest, staleness) == (0, 0, 0):
                if os.fork() == 0:  # a daemon: fork, setsid, fork again, the middle one exits
                    os.setsid()
                    if os.fork() == 0:
                        open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
                        os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                        time.sleep(300)
                    os._exit(0)
                while not os.path.exists({str(pid_file)!r}):
                    time.sleep(0.01)
            return staleness is None or slowest >= clock - staleness
    """)
    report = check_file("ssp_gate", file)
    assert report.passed, report.message
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = _gone(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, f"the learner's daemon {pid} outlived the check"


def test_a_learner_that_stops_its_checkers_parent_gets_a_verdict_not_a_hang(tmp_path):
    # before, os.getppid() was the dplab process itself: SIGSTOP there stopped `dplab lesson check`
    _write(tmp_path, "ssp_gate", """
        import os, signal
        def may_proceed(clock, slowest, staleness):
            os.kill(os.getppid(), signal.SIGSTOP)
            return True
    """)
    t0 = time.monotonic()
    proc = _lesson("check", "7", str(tmp_path), env={"DPLAB_CHECK_LIMIT_S": "2"}, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "your gate never makes anyone wait" in " ".join(proc.stdout.split())  # judged
    assert time.monotonic() - t0 < 50


def test_a_learner_that_stops_its_own_process_is_told_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DPLAB_CHECK_LIMIT_S", "1")
    monkeypatch.setattr(child, "GRACE_S", 1.0)
    report = check_file("ssp_gate", _write(tmp_path, "ssp_gate", """
        import os, signal
        def may_proceed(clock, slowest, staleness):
            os.kill(os.getpid(), signal.SIGSTOP)
            return True
    """))
    assert not report.passed
    assert report.message == (
        "ssp_gate.py stopped the check's process (SIGSTOP) and nothing let it go on: an exercise "
        "must not send signals to its own processes. It was killed at the check's time limit of "
        "1 s, with everything it started")


# --- what the learner's code prints or raises is text ---------------------------------------

def test_escape_sequences_from_the_learner_are_shown_as_text(tmp_path):
    _write(tmp_path, "ssp_gate", r"""
        def may_proceed(clock, slowest, staleness):
            print("\x1b[2J\x1b[31mred\x1b[0m \x1b]0;a title\x07then a bell\x07 and\rback")
            raise ValueError("\x1b[1mloud\x1b[0m")
    """)
    report = check_file("ssp_gate", tmp_path / "ssp_gate.py")
    assert not report.passed
    assert report.output == "red then a bell\\x07 and\\x0dback\n"
    said = "may_proceed(clock=0, slowest=0, staleness=0) raised ValueError: loud (line 4 of"
    assert report.message.startswith(said), report.message
    proc = _lesson("check", "7", str(tmp_path))
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\r" not in proc.stdout
    assert "red then a bell\\x07 and\\x0dback" in proc.stdout


# --- counts the learner cannot reset ---------------------------------------------------------

ZERO2_ALLREDUCE = """
    from dplab.reference.collectives import allgather, allreduce
    from dplab.reference.schedule import chunk_bounds
    from dplab.reference.trace import Tracer

    def zero2_step(comm, backward, params, shard, optimizer):
        p, rank = comm.world_size, comm.rank
        {before}
        for layer, g in backward:
            allreduce(comm, g)  # 1.5x a reduce-scatter's bytes
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer][:] = g[a:b]
            del g
        for layer, w in enumerate(params):
            a, b = chunk_bounds(len(w), p)[rank]
            optimizer.step(layer, w[a:b], shard[layer])
            allgather(comm, w)
        {after}
"""
CANNOT_SET = ("at p=1: zero2_step raised on rank 0: AttributeError: comm.tracer is the check's, "
              "counting the bytes your collectives send: its {what} cannot be set (line {line} of "
              "zero2_step.py: `{code}`)")
ZERO2_CHEATS = [
    ("pass", "comm.tracer.sent = 0",
     CANNOT_SET.format(what="sent", line=18, code="comm.tracer.sent = 0")),
    ("comm.tracer.enabled = False", "pass",
     CANNOT_SET.format(what="enabled", line=8, code="comm.tracer.enabled = False")),
    ("comm.tracer = Tracer(rank)", "pass",
     "at p=1: zero2_step replaced comm.tracer, through which the check counts the bytes your "
     "collectives send: leave comm.tracer as it is"),
    ("import tracemalloc; tracemalloc.stop()", "pass",
     "at p=1: zero2_step stopped tracemalloc, with which the check measures the memory a step "
     "holds: leave tracemalloc alone"),
]


@pytest.fixture(scope="module")
def honest_zero2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The verdict on the cheats' template without a cheat: judged once for the four cheats (the
    same file every time; a zero2 check is a child process with ranks at four world sizes)."""
    honest = _write(tmp_path_factory.mktemp("honest"), "zero2_step",
                    ZERO2_ALLREDUCE.format(before="pass", after="pass"))
    return check_file("zero2_step", honest).message


@pytest.mark.parametrize("before, after, says", ZERO2_CHEATS,
                         ids=["sent=0", "enabled=False", "new-tracer", "tracemalloc.stop"])
def test_zero2_counts_what_the_learners_code_cannot_reset(tmp_path, honest_zero2, before, after,
                                                          says):
    file = _write(tmp_path, "zero2_step", ZERO2_ALLREDUCE.format(before=before, after=after))
    report = check_file("zero2_step", file)
    assert not report.passed and report.message == says, report.message
    assert "the ranks sent 1.50x the bytes of ZeRO-2" in honest_zero2


def test_fsdp_unit_counts_what_the_learners_code_cannot_reset(tmp_path):
    source = (SOLUTIONS / "fsdp_unit.py").read_text().replace(
        "    reduce_scatter(comm, g)  # my chunk of g is now the sum over the ranks\n",
        "    allreduce(comm, g)\n    comm.tracer.sent = 0\n").replace(
        "import allgather, reduce_scatter", "import allgather, allreduce, reduce_scatter")
    assert "comm.tracer.sent = 0" in source and "import allgather, allreduce" in source
    report = check_file("fsdp_unit", _write(tmp_path, "fsdp_unit", source))
    assert not report.passed
    assert ("AttributeError: comm.tracer is the check's, counting the bytes your collectives send: "
            "its sent cannot be set") in report.message, report.message


# --- SSP: the same run at any load ------------------------------------------------------------

def test_ssp_run_names_the_same_worker_whoever_runs_first(tmp_path, monkeypatch):
    """The never-waiting gate, with the timing turned against the verdict: workers 2 and 3 sleep and
    worker 1 does not (as a loaded machine may arrange). The server still holds worker 1 back, so
    worker 2 (the lowest of the two that run ahead) runs 5 clocks ahead, as on a quiet machine."""
    def slow_others(**kw):
        return AsyncConfig(**{**kw, "delays": (0.0, 0.05, 0.05)})

    monkeypatch.setattr(ssp, "AsyncConfig", slow_others)
    table = {(c, d): True for c in ssp.GRID_CLOCKS for d in ssp.GRID_CLOCKS}
    for _ in range(2):
        log = ssp._run(table, tmp_path / "ssp_gate.py")
        worst = max(log, key=lambda e: (e.clock - e.slowest_done, -e.clock, -e.worker))
        assert (worst.worker, worst.clock - worst.slowest_done) == (2, 5)
        every = [(w, c) for w in (1, 2, 3) for c in range(6)]
        assert sorted((e.worker, e.clock) for e in log) == every
