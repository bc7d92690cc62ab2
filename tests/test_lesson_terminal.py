"""``dplab lesson`` in a real terminal (a pseudo-terminal), piped, and in-process.

The pty session is what a learner sees: lesson 1 stepped to its end with one "predict first"
question answered wrongly and two rightly, a hint, a step back; the screen must show the verdicts,
the checks' marks and the end. The rest: piped output is plain and complete, the position is
resumed, the listing, bad arguments (one line, exit 2), a failed claim (exit 1, named).
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from dplab.lessons import Check, Lesson, Predict, Step, lessons
from dplab.lessons.command import parse_request
from dplab.lessons.resume import Positions
from dplab.reference.errors import ConfigError

DPLAB = [sys.executable, "-m", "dplab.backends.cli", "lesson"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
SGR = re.compile(r"\x1b\[[0-9;]*m")   # colour and bold: what NO_COLOR forbids
PROMPT = "q: quit]>"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "TERM")
    }
    return {**env, "DPLAB_HOME": str(home), "TERM": "xterm-256color", **extra}


class Terminal:
    """A child process on a pseudo-terminal of 80x24: read its screen, type keys."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: an 80-column terminal, then the command
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            os.execvpe(argv[0], argv, env)
        self.raw, self.pos, self.status = "", 0, None

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        self.raw += data.decode("utf-8", "replace")
        return bool(data)

    def expect(self, pattern: str, timeout: float = 30) -> str:
        """Wait for ``pattern`` (regex) after what was matched last; return the text up to it."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.text, self.pos)
            if m:
                seen, self.pos = self.text[self.pos:m.end()], m.end()
                return seen
            if time.monotonic() > deadline or not self._read(0.2):
                raise AssertionError(f"no {pattern!r} on the screen; after position {self.pos} it "
                                     f"shows:\n{self.text[self.pos:][-3000:]}")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.05):  # what it wrote last
                    pass
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"still running after {timeout} s:\n{self.text[-2000:]}")


def test_a_learner_steps_through_lesson_1_in_a_terminal(tmp_path):
    first_step = lessons()[0].steps[0]
    hints = first_step.all_hints()
    t = Terminal(DPLAB + ["1"], _env(tmp_path))
    t.expect(r"Lesson 1 · step 1/4 · One model, four replicas")
    asked = t.expect(r"'identical', 'close'\s+or\s+'different' from each other\?"
                     r" \(identical / close / different\)")
    t.expect("your answer")
    # predict first: no code, no result yet
    assert "def " not in asked and "✓ holds" not in asked
    t.type("h\r")                                        # a hint before answering, not an answer
    t.expect(r"hint( 1/\d+)?: " + r"\s+".join(map(re.escape, hints[0].split()[:6])))
    t.expect("your answer")
    t.type("close\r")                                    # wrong: they are identical
    t.expect(r"✗ not quite: it is identical")
    first = t.expect(PROMPT)
    assert "✓ holds  every replica holds the same bits" in first
    assert "explore: dplab app, page /training?world_sizes=4&steps=50" in first
    assert first.index("✓ holds") < first.index("def ")       # the code comes after the result
    t.type("h\r")  # the next tier (or the only one again)
    t.expect(
        r"hint( \d+/\d+)?: "
        + r"\s+".join(map(re.escape, hints[min(1, len(hints) - 1)].split()[:6]))
    )
    t.expect(PROMPT)
    t.type("\r")
    t.expect(r"step 2/4 · Sharding the global batch")
    t.expect("how many samples does\\s+rank 0 get")
    t.expect("your answer")
    t.type("3\r")                                        # right
    t.expect(r"✓ right: 3")
    t.expect(r"Shard sizes: \[3, 3, 2, 2\]")
    t.expect(PROMPT)
    # back: step 1 again, not run or asked again
    t.type("b\r")
    back = t.expect(PROMPT)
    assert (
        "step 1/4" in back and "✗ not quite: it is identical" in back and "your answer" not in back
    )
    t.type("\r")
    again = t.expect(PROMPT)
    assert "step 2/4" in again and "✓ right: 3" in again and "your answer" not in again
    t.type("\r")
    t.expect(r"step 3/4 · Why every replica must stay identical")
    third = t.expect(PROMPT)
    assert "✓ holds  without the all-reduce the replicas drift apart" in third
    t.type("\r")
    t.expect(r"step 4/4")
    t.expect("your answer")
    t.type("0.1\r")                                      # right
    t.expect(r"✓ right: 0.1")
    t.expect(PROMPT)
    t.type("\r")
    t.expect(r"End of lesson 1 · Replicas that stay identical")
    t.expect(r"✓ 9 of 9 checks held in the 4 steps shown")
    assert t.wait() == 0
    assert "✗ FAILED" not in t.text and "Traceback" not in t.text
    assert SGR.search(t.raw), "a terminal without NO_COLOR gets colour"
    # finished: next time from step 1
    assert Positions.load(tmp_path / "lessons.json").step(1) is None
    assert set(Positions.load(tmp_path / "lessons.json").seconds(1)) == {1, 2, 3, 4}


def test_no_pause_piped_is_plain_complete_and_reads_nothing(tmp_path):
    proc = subprocess.run(
        DPLAB + ["1", "--no-pause"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and proc.stderr == ""
    for step in lessons()[0].steps:
        assert step.title in proc.stdout
    assert (
        "answer: identical" in proc.stdout
        and "answer: 3" in proc.stdout
        and "answer: 0.1" in proc.stdout
    )
    assert proc.stdout.count("✓ holds") == 9
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    assert not any(line.endswith(" ") for line in proc.stdout.splitlines())
    assert not (tmp_path / "lessons.json").exists()   # a script leaves the learner's place alone


def test_no_color_terminal_has_no_colour_codes(tmp_path):
    """(The same list on a terminal without NO_COLOR is coloured: the first test sees SGR codes.)"""
    plain = Terminal(DPLAB, _env(tmp_path, NO_COLOR="1"))
    assert plain.wait() == 0
    assert not SGR.search(plain.raw) and "Replicas that stay identical" in plain.text


def test_resume_where_the_learner_stopped(tmp_path):
    env = _env(tmp_path)
    first = subprocess.run(
        DPLAB + ["1", "--step", "2"],
        env=env,
        input="3\n\nq\n",
        capture_output=True,
        # step 2 answered, on to step 3, quit
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    assert "✓ right: 3" in first.stdout and "Stopped at step 3/4" in first.stdout
    assert Positions.load(tmp_path / "lessons.json").step(1) == 3
    again = subprocess.run(
        DPLAB + ["1"], env=env, input="", capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr                    # end of input: quits, saving
    assert "Resuming lesson 1 at step 3/4" in again.stdout
    assert "step 3/4" in again.stdout and "step 1/4" not in again.stdout
    assert Positions.load(tmp_path / "lessons.json").step(1) == 3


def test_ctrl_c_saves_the_position_and_exits_130(tmp_path):
    t = Terminal(DPLAB + ["1", "--step", "2"], _env(tmp_path))
    t.expect("your answer")
    t.type("3\r")
    t.expect(PROMPT)
    t.type("\r")                                         # on to step 3, where Ctrl-C comes
    t.expect(r"step 3/4[\s\S]*" + re.escape(PROMPT))
    # as a person would: a signal in the instant before input() blocks is only seen later
    time.sleep(0.5)
    t.type("\x03")
    assert t.wait() == 130
    assert (
        "stopped at step 3/4; dplab lesson 1 resumes there" in t.text and "Traceback" not in t.text
    )
    assert Positions.load(tmp_path / "lessons.json").step(1) == 3


def test_the_list_and_a_corrupt_position_file(tmp_path):
    (tmp_path / "lessons.json").write_text("{not json")
    proc = subprocess.run(DPLAB, env=_env(tmp_path, COLUMNS="200"), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    (warning,) = proc.stderr.splitlines()
    assert warning.startswith("dplab lesson: warning: ignoring") and "corrupt" in warning
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["#", "lesson", "steps", "time", "progress", "score", "needs"]
    for les in lessons():
        (row,) = [r for r in rows if r.split()[:1] == [str(les.number)]]
        assert les.title in row and f" {len(les.steps)} " in row and re.search(r"~\d+ min", row)


def test_a_step_past_the_end_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        DPLAB + ["1", "--step", "99"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "dplab lesson: error: lesson 1 has 4 steps: --step must be 1..4, got 99\n"


@pytest.mark.parametrize("argv, message", [
    (["99"], "there is no lesson 99"),
    (["one"], "expected a lesson number, got 'one'"),
    (["1", "--step", "0"], "argument --step: must be an integer >= 1, got 0"),
    (["check", "1", "d", "e"], "usage: dplab lesson check N [DIR]"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    from dplab.backends.cli.commands import main

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    try:
        rc = main(["lesson", *argv])
    except SystemExit as e:  # argparse's own checks (--step 0)
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("dplab lesson: error: ") and message in line


@pytest.mark.parametrize("words, step, no_pause, message", [
    (["init"], None, False, "usage: dplab lesson init DIR"),
    (["check"], None, False, "usage: dplab lesson check N [DIR]"),
    (["check", "x"], None, False, "expected a lesson number"),
    (["init", "d"], 2, False, "--step and --no-pause go with a lesson number"),
    ([], None, True, "need a lesson number"),
    (["1", "2"], None, False, "one lesson at a time"),
])
def test_requests_that_make_no_sense(words, step, no_pause, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_request(words, step, no_pause)


def test_requests():
    assert parse_request([]).action == "list"
    assert parse_request(["2"], 3, True) == parse_request(["2"], 3, True).__class__(
        "run", 2, None, 3, False
    )
    assert (
        parse_request(["check", "2"]).path is None
        and parse_request(["check", "2", "d"]).path == "d"
    )
    assert parse_request(["init", "d"]).path == "d"


def _lesson(*steps: Step) -> Lesson:
    return Lesson(99, "fake", "A fake lesson", "For the tests.", steps)


def _facts(lab):
    return {"x": 3}


def test_no_pause_exits_1_naming_the_claim_that_did_not_hold(tmp_path, monkeypatch, capsys):
    from dplab.lessons.terminal import run_lesson

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("must not be read"))
    fails = Check("x is {x} but should be 4", lambda f: f["x"] == 4)
    lesson = _lesson(
        Step("Holds", "x is {x}", _facts, (Check("x is three", lambda f: f["x"] == 3),)),
        Step("Fails", "x is {x}", _facts, (fails,), predict=Predict("What is x?", "x")),
    )
    screen = io.StringIO()
    assert run_lesson(lesson, pause=False, console=Console(file=screen, width=80)) == 1
    err = capsys.readouterr().err
    assert err == "dplab lesson 99: step 2 (Fails): 'x is 3 but should be 4' did not hold\n"
    text = screen.getvalue()
    assert "✗ FAILED  x is 3 but should be 4" in text and "✓ holds  x is three" in text
    assert "answer: 3" in text and sys.stdin.read() == "must not be read"


def test_keys_in_process_back_at_the_first_step_hint_and_unknown_keys(tmp_path, monkeypatch):
    from dplab.lessons.terminal import run_lesson

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("b\nx\nh\n\n7\nq\n"))
    true = (Check("x", lambda f: True),)
    lesson = _lesson(Step("One", "x is {x}", _facts, true, hint="look at x"),
                     Step("Two", "x is {x}", _facts, true, predict=Predict("x?", "x")))
    screen = io.StringIO()
    assert run_lesson(lesson, console=Console(file=screen, width=80)) == 0
    text = screen.getvalue()
    assert "This is the first step." in text and "'x': type Enter, b, h or q" in text
    assert "hint: look at x" in text and "✗ not quite: it is 3 (you said 7" in text
    assert "Stopped at step 2/2" in text and Positions.load(tmp_path / "lessons.json").step(99) == 2


@pytest.mark.parametrize("content, why", [("{not json", "corrupt"), ("[1, 2]", "corrupt"),
                                          ('{"lessons": {"1": 3}}', "corrupt")])
def test_a_corrupt_position_file_is_ignored_and_rewritten(tmp_path, content, why):
    path = tmp_path / "lessons.json"
    path.write_text(content)
    positions = Positions.load(path)
    assert why in positions.warning and positions.step(1) is None and positions.seconds(1) == {}
    assert positions.save(1, 2, {1: 0.5}) is None
    again = Positions.load(path)
    assert again.warning is None and again.step(1) == 2 and again.seconds(1) == {1: 0.5}


def test_a_position_that_cannot_be_saved_is_a_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    positions = Positions.load(blocker / "lessons.json")   # a folder that is a file
    assert "cannot read" in positions.warning and positions.step(1) is None
    assert "cannot save the position" in positions.save(1, 2)


def test_the_ticker_appears_only_for_a_run_longer_than_its_delay():
    from dplab.lessons.ticker import Ticker

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80)
    with Ticker(terminal, "quick", expected_s=1.0, delay_s=5.0) as quick:
        pass
    assert not quick.shown and screen.getvalue() == ""
    with Ticker(terminal, "slow step", expected_s=10.0, delay_s=0.05) as slow:
        time.sleep(0.5)
    assert (
        slow.shown and "slow step" in ANSI.sub("", screen.getvalue()) and "eta" in screen.getvalue()
    )
    piped = io.StringIO()
    with Ticker(Console(file=piped, width=80), "piped", delay_s=0.01) as quiet:
        time.sleep(0.2)
    assert not quiet.shown and piped.getvalue() == ""


class _Report:
    def __init__(self, name: str, passed: bool, message: str) -> None:
        self.name, self.passed, self.message = name, passed, message


def test_init_and_check_render_the_exercises_reports(tmp_path, monkeypatch, capsys):
    from dplab.backends.cli.commands import main

    calls = []
    fake = type(sys)("dplab.lessons.exercises")
    fake.init_dir = lambda path: calls.append(("init", path)) or [path / "ring.py"]
    fake.check = lambda n, path: calls.append(("check", n, path)) or [
        _Report("ring", False, "rank 2 ends with chunk 1 counted twice after round 3"),
        _Report("buckets", True, "your buckets match the engine's")]
    monkeypatch.setitem(sys.modules, "dplab.lessons.exercises", fake)
    assert main(["lesson", "init", str(tmp_path)]) == 0
    # the terminal wraps a long path onto its own line: compare the words, not the line breaks
    assert f"wrote {tmp_path / 'ring.py'}" in " ".join(capsys.readouterr().out.split())
    assert main(["lesson", "check", "2", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "✗ failed" in out and "rank 2 ends with chunk 1 counted twice after round 3" in out
    assert "✓ passed" in out and "1 of 2 exercises of lesson 2 pass" in out
    assert calls == [("init", tmp_path), ("check", 2, tmp_path)]
    fake.check = lambda n, path: [_Report("ring", True, "ok")]
    assert main(["lesson", "check", "2"]) == 0


def _blocks_sigint(native_id: int) -> bool:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads thread signal masks from "
                                                                 "/proc")
def test_the_tickers_threads_leave_ctrl_c_to_the_main_thread():
    """A SIGINT the kernel hands to the timer or to rich's refresh thread would not interrupt the
    main thread's blocking run or input(): both threads block it, the main thread does not."""
    from dplab.lessons.ticker import Ticker

    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    with Ticker(terminal, "waiting", delay_s=5.0) as waiting:
        assert _blocks_sigint(waiting._timer.native_id)
    with Ticker(terminal, "shown", delay_s=0.01) as shown:
        time.sleep(0.3)
        assert shown.shown and _blocks_sigint(shown._bar.live._refresh_thread.native_id)
    assert not _blocks_sigint(threading.get_native_id())


def _breaks(lab):
    raise ConfigError("the engine said no")


def test_a_step_that_cannot_run_is_one_line_exit_1_and_keeps_the_place(
    tmp_path, monkeypatch, capsys
):
    from dplab.lessons.terminal import run_lesson

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    lesson = _lesson(Step("Fine", "x is {x}", _facts), Step("Broken", "-", _breaks))
    assert run_lesson(lesson, console=Console(file=io.StringIO(), width=80)) == 1
    assert capsys.readouterr().err == "dplab lesson 99: step 2 could not run: the engine said no\n"
    assert Positions.load(tmp_path / "lessons.json").step(99) == 2


def test_missing_extras_are_named_with_their_pip_command(monkeypatch):
    from dplab.lessons import render, runner
    from dplab.lessons.terminal import run_lesson

    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None)
    lesson = Lesson(
        12, "engines", "Engines", "-", (Step("One", "-", _facts),), needs=("torch", "mpi")
    )
    with pytest.raises(ConfigError, match=re.escape("needs the torch, mpi extra: pip install "
                                                    "'dplab[torch]'; pip install 'dplab[mpi]'")):
        run_lesson(lesson, console=Console(file=io.StringIO()))
    screen = io.StringIO()
    Console(file=screen, width=120).print(render.lessons_table([(lesson, ["mpi"], 130.0, 1)]))
    text = screen.getvalue()
    assert (
        "torch, mpi" in text
        and "mpi missing: pip install 'dplab[mpi]'" in text
        and "~2 min" in text
    )
    assert "Engines (resumes at step 1)" in text


def test_the_list_works_without_torch(tmp_path):
    """The list reads each step's shown code to estimate a lesson's length: a lesson whose extras
    are missing is listed with them named, not a failed import of the code it would show."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nfrom importlib.machinery import PathFinder\n\n\n"
        "class NoTorch(PathFinder):\n    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n            return None\n"
        "        return PathFinder.find_spec(name, path, target)\n\n\n"
        "sys.meta_path[:] = [NoTorch if f is PathFinder else f for f in sys.meta_path]\n")
    env = _env(tmp_path, COLUMNS="200", PYTHONPATH=str(hide))
    proc = subprocess.run(DPLAB, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {r.split()[0]: r for r in proc.stdout.splitlines() if r.strip()}
    for number in ("12", "14", "15"):
        assert "torch" in rows[number] and re.search(r"~\d+ min", rows[number]), rows[number]
