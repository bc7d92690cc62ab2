"""``dplab lesson`` against what a learner's code and a learner's files can do to it.

``dplab lesson check`` runs the learner's code in a child process: a loop (even one that swallows
the stop), an exit, a fork, a patched checker, a giant answer or message, memory and a full
/dev/shm each end as one honest line, quickly. ``lessons.json`` that is broken in any way is a
warning, never a traceback or a hang, and two runs at once keep both places. ``lesson init``
refuses what would write somewhere else. A reply of any length is judged at once.

The time-limit tests use ``DPLAB_CHECK_LIMIT_S`` of a second or so, not the default 30 s.

    pytest -q tests/test_lesson_hardening.py
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from dplab.lessons import Check, Lesson, Predict, Step
from dplab.lessons.exercises import SOLUTIONS, check, check_file, child, init_dir
from dplab.lessons.exercises.learner import CheckUnavailable, rank_failure
from dplab.lessons.resume import Positions
from dplab.reference.errors import ConfigError

DPLAB = [sys.executable, "-m", "dplab.backends.cli", "lesson"]
RIGHT_RING = (
    "from dplab.lessons.exercises.solutions.ring_reduce_scatter import ring_reduce_scatter as right"
)
RIGHT_ZERO2 = "from dplab.lessons.exercises.solutions.zero2_step import zero2_step as right"


def _write(folder: Path, name: str, source: str) -> Path:
    file = folder / f"{name}.py"
    file.write_text(textwrap.dedent(source))
    return file


def _timed(name: str, file: Path) -> tuple[object, float]:
    t0 = time.monotonic()
    report = check_file(name, file)
    return report, time.monotonic() - t0


def _gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for a reaper that is not ours counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setenv("DPLAB_CHECK_LIMIT_S", "1")
    monkeypatch.setattr(child, "GRACE_S", 1.0)
    return 1.0


# --- time -----------------------------------------------------------------------------------------

def test_a_loop_at_module_level_is_stopped_and_named(tmp_path, short_limit):
    file = _write(tmp_path, "ring_reduce_scatter", """
        import numpy
        while True:
            pass
    """)
    report, took = _timed("ring_reduce_scatter", file)
    assert not report.passed
    assert report.message == ("importing ring_reduce_scatter.py raised TooLong: still running "
                              "after 1 s: does a loop never end? (line 3 of "
                              "ring_reduce_scatter.py: `while True:`)")
    assert took < 20


def test_a_loop_that_swallows_the_stop_is_killed_with_what_it_started(tmp_path, short_limit):
    file = _write(tmp_path, "ring_reduce_scatter", f"""
        import os, time
        def ring_reduce_scatter(p):
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
            # by the parent: no race with the kill
            open({str(tmp_path / 'pid')!r}, "w").write(str(pid))
            while True:
                try:
                    while True:
                        pass
                except BaseException:
                    pass
    """)
    report, took = _timed("ring_reduce_scatter", file)
    assert not report.passed
    said = ("ring_reduce_scatter.py was still running 2 s in, 1 s after the check's time limit of "
            "1 s asked it to stop: does a loop catch every exception")
    assert report.message.startswith(said), report.message
    assert took < 25
    assert _gone(int((tmp_path / "pid").read_text()))


def test_a_zero2_step_that_loops_at_one_rank_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("DPLAB_CHECK_LIMIT_S", "3")
    file = _write(tmp_path, "zero2_step", """
        def zero2_step(comm, backward, params, shard, optimizer):
            while comm.world_size == 1:
                pass
    """)
    report, took = _timed("zero2_step", file)
    assert not report.passed
    # the rank stops itself and names the line; on a slow machine the child's own stop may come
    # first
    assert re.match(r"at p=1: zero2_step (raised on rank 0: TooLong: still running at the check's "
                    r"time limit "
                    r"of 3 s: does a loop never end\? \(line 3 of zero2_step.py: `while "
                    r"comm.world_size == "
                    r"1:`\)|still running after 3 s)", report.message), report.message
    assert took < 30


@pytest.mark.parametrize("answer", ["(b for b in iter(lambda: [0], None))", "[[0]] * 10**7"],
                         ids=["endless-generator", "giant-list"])
def test_an_endless_or_giant_answer_is_read_only_so_far(tmp_path, answer):
    file = _write(tmp_path, "ddp_buckets", f"""
        def ddp_buckets(sizes, cap):
            return {answer}
    """)
    report, took = _timed("ddp_buckets", file)
    assert not report.passed
    assert re.match(r"ddp_buckets\(\[.*\], 600\) returned more than 10,000 parameter indices: "
                    r"return one "
                    r"list of indices per bucket", report.message), report.message
    assert took < 20


# --- how the learner's code can end ---------------------------------------------------------------

OS_EXIT = ("ring_reduce_scatter.py ended the check's process with exit code 0 before answering: an "
           "exercise returns its answer; remove os._exit (or exit) from it")
EXITS = [
    ("import sys\nsys.exit(0)\n",
     "importing ring_reduce_scatter.py called sys.exit(0): an exercise returns its answer instead "
     "of ending the program (line 2 of ring_reduce_scatter.py: `sys.exit(0)`)"),
    ("import sys\ndef ring_reduce_scatter(p):\n    sys.exit()\n",
     "ring_reduce_scatter(1) called sys.exit(): an exercise returns its answer instead of ending "
     "the program (line 3 of ring_reduce_scatter.py: `sys.exit()`)"),
    ("import os\nos._exit(0)\n", OS_EXIT),
    ("import os\ndef ring_reduce_scatter(p):\n    os._exit(0)\n", OS_EXIT),
    ("import os, signal\ndef ring_reduce_scatter(p):\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
     "ring_reduce_scatter.py ended the check's process with SIGSEGV (a crash in native code) "
     "before answering"),
]


@pytest.mark.parametrize(
    "source, says",
    EXITS,
    ids=["sys.exit-import", "sys.exit-call", "os._exit-import", "os._exit-call", "SIGSEGV"],
)
def test_every_way_the_learners_code_ends_is_one_line(tmp_path, source, says):
    (tmp_path / "ring_reduce_scatter.py").write_text(source)
    report = check(2, tmp_path)[0]  # lesson 2's first exercise: the ring reduce-scatter
    assert not report.passed and report.message == says


def test_a_patched_checker_is_named_and_judged_anyway(tmp_path):
    _write(tmp_path, "ring_reduce_scatter", """
        import dplab.lessons.exercises.ring as r
        r.ring_problem = lambda *a: None
        def ring_reduce_scatter(p):
            return None
    """)
    proc = subprocess.run(
        [*DPLAB, "check", "2", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("ring_reduce_scatter.py replaced dplab.lessons.exercises.ring.ring_problem: an answer "
            "is judged by what its function returns") in proc.stdout
    assert "0 of 3 exercises of lesson 2 pass" in proc.stdout


def test_a_learners_fork_reports_once_and_its_process_ends(tmp_path):
    _write(tmp_path, "ring_reduce_scatter", RIGHT_RING + f"""
import os, time
def ring_reduce_scatter(p):
    if p == 2:
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
        open({str(tmp_path / 'sleeper')!r}, "w").write(str(pid))
    if p == 3:
        os.fork()  # both processes come back with an answer
    print("computing", p)
    return right(p)
""")
    for other in ("ring_allgather", "tree_broadcast"):  # lesson 2's other exercises, answered
        shutil.copy(SOLUTIONS / f"{other}.py", tmp_path)
    proc = subprocess.run(
        [*DPLAB, "check", "2", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("3 of 3 exercises of lesson 2 pass") == 1
    assert "ring_reduce_scatter printed:" in proc.stdout and "computing 8" in proc.stdout
    assert _gone(int((tmp_path / "sleeper").read_text()))


def test_a_process_a_rank_forked_does_not_outlive_the_world(tmp_path):
    _write(tmp_path, "zero2_step", RIGHT_ZERO2 + f"""
import os, time
def zero2_step(comm, backward, params, shard, optimizer):
    if comm.world_size == 2 and comm.rank == 1 and not os.path.exists({str(tmp_path /
    'sleeper')!r}):
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
        open({str(tmp_path / 'sleeper')!r}, "w").write(str(pid))
    right(comm, backward, params, shard, optimizer)
""")
    report, took = _timed("zero2_step", tmp_path / "zero2_step.py")
    assert report.passed, report.message
    assert _gone(int((tmp_path / "sleeper").read_text()))
    assert took < 30


def test_a_huge_exception_message_is_clipped_at_once(tmp_path):
    _write(tmp_path, "ring_reduce_scatter", """
        def ring_reduce_scatter(p):
            raise ValueError("x" * 5_000_000)
    """)
    report, took = _timed("ring_reduce_scatter", tmp_path / "ring_reduce_scatter.py")
    assert report.message.startswith("ring_reduce_scatter(1) raised ValueError: xxx")
    assert "(4,999,400 more characters) (line 3 of ring_reduce_scatter.py" in report.message
    assert len(report.message) < 1000 and took < 20
    _write(tmp_path, "zero2_step", """
        def zero2_step(comm, backward, params, shard, optimizer):
            raise ValueError("y" * 5_000_000)
    """)
    report, took = _timed("zero2_step", tmp_path / "zero2_step.py")
    assert report.message.startswith("at p=1: zero2_step raised on rank 0: ValueError: yyy"), (
        report.message
    )
    assert "(line 3 of zero2_step.py: `raise ValueError(" in report.message
    assert len(report.message) < 1000 and took < 30


def test_memory_beyond_the_limit_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DPLAB_CHECK_MEMORY_MB", "512")
    _write(tmp_path, "ring_reduce_scatter", """
        import numpy as np
        def ring_reduce_scatter(p):
            return np.ones(2**28)  # 2 GiB
    """)
    report, _ = _timed("ring_reduce_scatter", tmp_path / "ring_reduce_scatter.py")
    assert report.message.startswith("ring_reduce_scatter(1) raised MemoryError"), report.message
    assert (
        "(the check allows 512 MiB of memory; $DPLAB_CHECK_MEMORY_MB sets that)" in report.message
    )


def test_what_the_learner_prints_is_kept_clipped(tmp_path):
    _write(tmp_path, "ring_reduce_scatter", """
        def ring_reduce_scatter(p):
            if p == 1:
                print("z" * 3_000_000)
    """)
    report, _ = _timed("ring_reduce_scatter", tmp_path / "ring_reduce_scatter.py")
    assert "returned NoneType, not a Schedule" in report.message
    assert report.output.startswith("z" * child.OUTPUT_CHARS)
    assert len(report.output) < child.OUTPUT_CHARS + 100
    assert re.search(r"\.\.\. \(2,99\d,\d{3} more bytes of output\)", report.output), report.output[
        -100:
    ]


# --- a full /dev/shm is the machine's problem, not the answer's -----------------------------------

def _no_room() -> None:
    """The test's child: files (so /dev/shm segments) of at most 1 KiB, reported, not a signal."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_full_dev_shm_is_one_line_about_the_machine_not_a_wrong_answer():
    proc = subprocess.run([*DPLAB, "check", "10", str(SOLUTIONS)], capture_output=True, text=True,
                          timeout=120, preexec_fn=_no_room)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith("dplab lesson: error: cannot check zero2_step.py on this machine: "
                           "/dev/shm is full: ")


def test_a_rank_that_found_dev_shm_full_is_the_machines_problem(tmp_path):
    from dplab.backends import RankError

    file = tmp_path / "zero2_step.py"
    full = ('Traceback (most recent call last):\n'
            '  File "/x/dplab/backends/local/shm.py", line 9, in _reserve\n'
            "    os.posix_fallocate(fd, 0, size)\n"
            "dplab.backends.local.shm.ShmFull: /dev/shm is full: segment dplab_1_r0 needs 4 KiB, 2 "
            "KiB is free there\n")
    failure = rank_failure(RankError(1, full), file, "zero2_step")
    assert isinstance(failure, CheckUnavailable)
    assert str(failure) == ("cannot check zero2_step.py on this machine: ShmFull: /dev/shm is "
                            "full: segment dplab_1_r0 needs 4 KiB, 2 KiB is free there")
    inside = full.replace("  File \"/x/", f"  File \"{file}\", line 3, in zero2_step\n    "
                                          "allgather(comm, "
                                            # a collective of theirs allocating
                                            "params)\n  File \"/x/")
    assert isinstance(rank_failure(RankError(1, inside), file, "zero2_step"), CheckUnavailable)
    # an OSError of the learner's own
    theirs = full.replace("dplab.backends.local.shm.ShmFull", "OSError")
    theirs = theirs.replace('"/x/dplab/backends/local/shm.py"', f'"{file}"')
    assert not isinstance(rank_failure(RankError(1, theirs), file, "zero2_step"), CheckUnavailable)


def test_the_checkers_own_run_on_a_full_dev_shm_is_the_machines_problem(monkeypatch):
    from dplab.backends.local.shm import shm_full
    from dplab.lessons.exercises import buckets

    def no_room(*args, **kwargs):
        raise shm_full(4096, "segment dplab_1_ctl")

    monkeypatch.setattr(buckets, "launch", no_room)
    with pytest.raises(CheckUnavailable, match=r"^cannot check ddp_buckets.py on this machine: "
                                               r"/dev/shm is "):
        check(4, SOLUTIONS)


# --- lessons.json ---------------------------------------------------------------------------------

BROKEN = {
    "not-utf8": (b'{"lessons": {"1": {"step": 2}}}\xff\xfe', "not UTF-8 text"),
    "1e309": (b'{"lessons": {"1": {"step": 2, "seconds": {"1": 1e309}}}}', "1e309 is beyond a "
                                                                           "float's range"),
    "NaN": (b'{"lessons": {"1": {"seconds": {"1": NaN}}}}', "NaN is not a number JSON allows"),
    "deep": (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    "huge": (b'{"lessons": {}, "x": "' + b"a" * (2 << 20) + b'"}', "larger than 1 MiB"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_positions_file_is_a_warning_and_rewritten(tmp_path, name):
    content, why = BROKEN[name]
    path = tmp_path / "lessons.json"
    path.write_bytes(content)
    positions = Positions.load(path)
    assert (
        positions.warning
        == f"ignoring {path}, which is corrupt ({why}); it is rewritten on the next save"
    )
    assert positions.step(1) is None and positions.seconds(1) == {}
    assert positions.save(1, 2, {1: 0.5}) is None
    again = Positions.load(path)
    assert again.warning is None and again.step(1) == 2 and again.seconds(1) == {1: 0.5}


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_positions_file_that_is_no_file_is_neither_read_nor_written_into(tmp_path, kind):
    path = tmp_path / "lessons.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    t0 = time.monotonic()
    positions = Positions.load(path)
    assert time.monotonic() - t0 < 5
    assert positions.warning == (f"ignoring {path}, which is corrupt (not a regular file); it is "
                                 "rewritten on the next save")
    assert positions.save(3, 4) is None
    assert path.is_file() and not path.is_symlink() and Positions.load(path).step(3) == 4


def test_a_link_to_a_real_positions_file_is_written_through(tmp_path):
    real = tmp_path / "dotfiles" / "lessons.json"
    real.parent.mkdir()
    real.write_text('{"lessons": {"1": {"step": 5}}}')
    link = tmp_path / "lessons.json"
    link.symlink_to(real)
    assert Positions.load(link).save(2, 3) is None
    assert link.is_symlink()
    saved = json.loads(real.read_text())["lessons"]
    assert saved["1"] == {"step": 5} and saved["2"]["step"] == 3


_SAVER = """
import sys
from pathlib import Path
from dplab.lessons.resume import Positions
path, lesson = Path(sys.argv[1]), int(sys.argv[2])
positions = Positions.load(path)          # loaded once, as a lesson run does
for step in range(1, 41):
    assert positions.save(lesson, step, {step: 0.1}) is None
"""


def test_two_runs_at_once_keep_both_places(tmp_path):
    path = tmp_path / "lessons.json"
    runs = [subprocess.Popen([sys.executable, "-c", _SAVER, str(path), str(n)]) for n in (1, 2)]
    assert [r.wait(timeout=120) for r in runs] == [0, 0]
    positions = Positions.load(path)
    assert positions.warning is None and positions.step(1) == 40 and positions.step(2) == 40
    assert len(positions.seconds(1)) == 40 and len(positions.seconds(2)) == 40
    # no temp left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lessons.json", "lessons.json.lock"]


# --- lesson init ----------------------------------------------------------------------------------

def test_init_into_an_empty_name_is_refused_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from dplab.backends.cli.commands import main

    monkeypatch.chdir(tmp_path)
    assert main(["lesson", "init", ""]) == 2
    assert capsys.readouterr().err == ("dplab lesson: error: dplab lesson init needs a folder "
                                       "name: dplab lesson init DIR (an empty name would be the "
                                       "current folder; say . if that is what you mean)\n")
    assert list(tmp_path.iterdir()) == []


def test_init_under_a_file_or_where_it_may_not_write_is_one_line(tmp_path, monkeypatch, capsys):
    from dplab.backends.cli.commands import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main(["lesson", "init", str(tmp_path / "notes.txt" / "work")]) == 2
    assert capsys.readouterr().err == ("dplab lesson: error: cannot create the folder "
                                       f"{tmp_path}/notes.txt/work (Not a directory): give dplab "
                                       "lesson init a folder you can write to\n")
    with pytest.raises(ConfigError, match=r"^cannot create the folder /proc/dplab-work \("):
        init_dir("/proc/dplab-work")  # read-only even for root

    from dplab.lessons import exercises

    calls = []

    def fails_third(target, data):
        if len(calls) == 2:
            raise PermissionError(13, "Permission denied")
        calls.append(target)
        target.write_bytes(data)

    monkeypatch.setattr(exercises, "_write_new", fails_third)
    with pytest.raises(ConfigError, match=r"^cannot write .*/work/\w+\.py \(Permission denied\): "
                                          r"give "):
        init_dir(tmp_path / "work")
    assert list((tmp_path / "work").iterdir()) == []  # all or nothing


def test_init_never_follows_a_link_out_of_the_folder(tmp_path):
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    (work / "ssp_gate.py").symlink_to(outside / "ssp_gate.py")  # dangling
    with pytest.raises(ConfigError, match=r"ssp_gate.py already exists: dplab lesson init never "
                                          r"overwrites"):
        init_dir(work)
    assert not outside.exists() and [p.name for p in work.iterdir()] == ["ssp_gate.py"]


# --- replies --------------------------------------------------------------------------------------

def _facts(lab):
    return {"x": 3}


def test_a_reply_of_a_digit_and_thousands_of_letters_is_judged_at_once(tmp_path, monkeypatch):
    from dplab.lessons.terminal import run_lesson

    predict = Predict("x?", "x")
    reply = "1" + "b" * 20_000
    verdict = predict.judge({"x": 3}, reply)
    assert (
        not verdict.correct
        and verdict.message == f"'1{'b' * 39}...' is not a number; the answer is 3"
    )
    assert (
        predict.judge({"x": 3}, "3 bytes").correct and not predict.judge({"x": 3}, "1e309").correct
    )

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO(reply + "\nq\n"))
    lesson = Lesson(
        99,
        "test",
        "Test",
        "-",
        (Step("One", "x is {x}", _facts, (Check("x", lambda f: True),), predict=predict),),
    )
    screen = io.StringIO()
    assert run_lesson(lesson, console=Console(file=screen, width=80)) == 0
    assert "is not a number; the answer is 3" in screen.getvalue()
