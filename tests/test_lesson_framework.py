"""The lesson framework's contracts (issue 22): predict first, the spine's code shown, plain
numbers, named misconceptions, tiered hints, terminal pictures, progress and score, ``lesson
watch``.

    pytest -q -p no:cacheprovider tests/test_lesson_framework.py

Steps here are tiny fakes (no ranks), so each test takes milliseconds unless it says otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dplab.lessons import count, fill, num, size, times
from dplab.lessons.runner import Lab, run_step
from dplab.lessons.step import Check, Lesson, Predict, Step
from dplab.reference.algorithms import ring
from dplab.reference.errors import ConfigError
from dplab.reference.train.buckets import Reducer


def _ring_facts(lab):
    p, n = 4, 1 << 20
    return {"p": p, "n_bytes": n, "sent": 2 * (p - 1) * n // p}


RING = Step(
    "Bytes on the wire",
    "rank 0 sends {sent:size} ({sent:,} bytes)",
    _ring_facts,
    checks=(Check("{sent:,} is 2(p-1)/p n", lambda f: f["sent"] == 1_572_864),),
    predict=Predict(
        "At p={p}, how many bytes does rank 0 send for {n_bytes:size}?",
        "sent",
        unit="bytes",
        misconceptions=(
            (lambda g, f: g == f["n_bytes"] * (f["p"] - 1), "that is the naive root's share"),
            (1 << 20, "that is one copy of the buffer: it goes in 2(p-1) pieces"),
        ),
    ),
    hint="Each round moves one chunk of n/p.",
    hints=("There are 2(p-1) rounds.",),
    inputs={"p": 4, "n_bytes": 1 << 20},
    show=(ring.allreduce,),
)


# --- 3. plain words -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, want",
    [
        (3.0769230769230766, "3.08"),
        (0.25, "0.25"),
        (1.0, "1"),
        (2079.3, "2,080"),
        (0.000123456, "0.000123"),
        (1e-7, "1e-07"),
        (0.0, "0"),
        (-12.345, "-12.3"),
        (123456789.0, "123,000,000"),
    ],
)
def test_num_reads_three_significant_digits(value, want):
    assert num(value) == want


def test_times_size_count_and_fill_specs():
    assert times(4 / 1.3) == "3.08x"
    assert size(1_572_864) == "1.5 MiB" and size(512) == "512 bytes" and size(64 << 10) == "64 KiB"
    assert count(1_572_864) == "1,572,864"
    facts = {
        "r": 4 / 1.3,
        "b": 1_572_864,
        "loss": 0.123456789,
        "xs": [0.25, 2079.3],
        "n": 7,
        "ok": True,
    }
    assert fill("{r:times} {b:size} {b:count} {b:,} {loss} {loss:.5f} {xs} {n} {ok}", facts) == \
        "3.08x 1.5 MiB 1,572,864 1,572,864 0.123 0.12346 [0.25, 2080] 7 checked"
    with pytest.raises(ConfigError, match="needs the fact 'missing'"):
        fill("{missing}", facts)


def test_a_misconception_is_named_and_a_plain_wrong_reply_is_not():
    facts = {"p": 4, "n_bytes": 1 << 20, "sent": 1_572_864}
    naive = RING.predict.judge(facts, "3 MiB")
    assert not naive.correct and naive.misconception == "that is the naive root's share"
    assert "naive root" in naive.message and "1,572,864" in naive.message
    assert "one copy" in RING.predict.judge(facts, "1 MiB").misconception
    assert RING.predict.judge(facts, "7").misconception == ""
    assert RING.predict.judge(facts, "1.5 MiB").correct
    # torch's 1/p convention: a number names it, with a tolerance
    p = Predict(
        "What multiplies the gradient?",
        "scale",
        rel_tol=0.01,
        misconceptions=((0.25, "that is torch's 1/p convention: dplab weights by shard size"),),
    )
    v = p.judge({"scale": 1.0}, "1/4")
    assert not v.correct and "torch's 1/p convention" in v.message
    # choices: a choice names it, so does a one-argument predicate
    c = Predict("Same?", "same", choices=("identical", "close"),
                misconceptions=(("close", "floating-point sums can differ, but every rank sums "
                                          "alike"),))
    assert "every rank sums alike" in c.judge({"same": "identical"}, " Close ").message


def test_a_wrong_ratio_reads_plainly():
    v = Predict("?", "x").judge({"x": 3}, "4")
    assert "1.33x that" in v.message


# --- 2. the spine's code, not the harness ---------------------------------------------------------

def test_show_displays_the_spine_code_and_code_falls_back_to_the_harness():
    shown = RING.code()
    assert shown.startswith("# dplab.reference.algorithms.ring.allreduce\n")
    assert "def allreduce" in shown and "lab" not in shown.split("\n", 1)[1].split("def ", 1)[0]
    by_name = Step(
        "t", "", _ring_facts, show=("dplab.reference.train.buckets.Reducer.mark_param_as_ready",)
    )
    method = Step("t", "", _ring_facts, show=(Reducer.mark_param_as_ready,))
    assert by_name.code() == method.code() and "def mark_param_as_ready" in method.code()
    assert "# dplab.reference.train.buckets.Reducer.mark_param_as_ready" in method.code()
    plain = Step("t", "", _ring_facts)
    assert plain.code() == plain.harness() and "def _ring_facts(lab)" in plain.code()
    with pytest.raises(ConfigError, match="does not import"):
        Step("t", "", _ring_facts, show=("dplab.no_such.thing",)).code()


# --- 1. predict before you see: the framework's part ----------------------------------------------

def test_inputs_let_the_question_be_asked_before_the_run_and_must_agree_with_it():
    assert RING.asks_before_run()
    assert (
        fill(RING.predict.question, RING.inputs)
        == "At p=4, how many bytes does rank 0 send for 1 MiB?"
    )
    assert not Step("t", "", _ring_facts, predict=Predict("p={p}?", "sent")).asks_before_run()
    with Lab() as lab:
        out = run_step(RING, lab)
        assert (
            out.ok and out.facts["p"] == 4 and out.text == "rank 0 sends 1.5 MiB (1,572,864 bytes)"
        )
        liar = Step("t", "", _ring_facts, inputs={"p": 8})
        with pytest.raises(ConfigError, match="contradicts the step's inputs"):
            run_step(liar, lab)


def test_hints_are_tiered_in_order():
    assert RING.all_hints() == ("Each round moves one chunk of n/p.", "There are 2(p-1) rounds.")
    assert Step("t", "", _ring_facts).all_hints() == ()
    assert Step("t", "", _ring_facts, hints=("only",)).all_hints() == ("only",)


# --- 1 and 5 in the terminal: question first, tiered hints, q, score, start-here ------------------

def _terminal(monkeypatch, tmp_path, keys: str):
    import io

    from rich.console import Console

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO(keys))
    screen = io.StringIO()
    return screen, Console(file=screen, width=100)


def _seen_at_run(screen, log):
    def run(lab):
        log.append(screen.getvalue())
        return {"p": 4, "n_bytes": 1 << 20, "sent": 1_572_864, "secret": "SECRET-RESULT"}
    return run


def _quiz(run, **kw) -> Step:
    return Step(
        "Quiz",
        "the result is {secret}: {sent:,}",
        run,
        (Check("sent {sent:,}", lambda f: True),),
        predict=Predict(
            "At p={p}, bytes for {n_bytes:size}?",
            "sent",
            misconceptions=(((3 << 20), "that is the naive root's share"),),
        ),
        hint="one chunk a round",
        hints=("2(p-1) rounds",),
        **kw,
    )


def test_the_question_comes_before_the_run_the_code_and_the_result(monkeypatch, tmp_path):
    from dplab.lessons.terminal import run_lesson

    screen, console = _terminal(monkeypatch, tmp_path, "h\nh\nh\n3 MiB\n\n")
    log: list[str] = []
    step = _quiz(
        _seen_at_run(screen, log), inputs={"p": 4, "n_bytes": 1 << 20}, show=(ring.allreduce,)
    )
    les = Lesson(99, "fake", "Fake", "For the tests.", (step,))
    assert run_lesson(les, console=console) == 0
    text = screen.getvalue()
    (before_run,) = log
    # asked before the run: the question and both hints were on screen, nothing of the result or the
    # code
    assert "Predict first: At p=4, bytes for 1 MiB?" in before_run
    assert "hint 1/2: one chunk a round" in before_run and before_run.count("hint 2/2: 2(p-1) "
                                                                            "rounds") == 2
    assert (
        "SECRET" not in before_run
        and "def allreduce" not in before_run
        and "1,572,864" not in before_run
    )
    # h was never an answer: the one answer is the misconception, named
    assert text.count("not quite") == 1 and "that is the naive root's share" in text
    after = text[len(before_run):]
    assert after.index("not quite") < after.index("SECRET-RESULT") < after.index("def allreduce")
    assert "Predictions: 0 of 1 right." in text
    from dplab.lessons.resume import Positions
    positions = Positions.load(tmp_path / "lessons.json")
    assert positions.score(99) == (0, 1) and positions.done(99)
    assert positions.answers(99) == {1: ("3 MiB", False)}


def test_a_question_that_needs_the_run_runs_unseen_first(monkeypatch, tmp_path):
    from dplab.lessons.terminal import run_lesson

    screen, console = _terminal(monkeypatch, tmp_path, "1.5 MiB\n\n")
    log: list[str] = []
    les = Lesson(99, "fake", "Fake", "For the tests.", (_quiz(_seen_at_run(screen, log)),))
    assert run_lesson(les, console=console) == 0
    text = screen.getvalue()
    question = text.index("Predict first: At p=4")
    assert "Predict first" not in log[0]                    # ran first, out of sight ...
    # ... nothing shown
    assert "SECRET" not in text[:question] and "def run" not in text[:question]
    assert text.index("✓ right: 1,572,864") < text.index("SECRET-RESULT") < text.index("def run")
    assert "Predictions: 1 of 1 right." in text


def test_q_at_the_answer_prompt_quits_without_answering(monkeypatch, tmp_path):
    from dplab.lessons.resume import Positions
    from dplab.lessons.terminal import run_lesson

    screen, console = _terminal(monkeypatch, tmp_path, "q\n")
    log: list[str] = []
    step = _quiz(_seen_at_run(screen, log), inputs={"p": 4, "n_bytes": 1 << 20})
    les = Lesson(99, "fake", "Fake", "For the tests.", (step,))
    assert run_lesson(les, console=console) == 0
    text = screen.getvalue()
    assert (
        log == [] and "not quite" not in text and "SECRET" not in text and "1,572,864" not in text
    )
    assert "Stopped at step 1/1" in text
    positions = Positions.load(tmp_path / "lessons.json")
    assert positions.step(99) == 1 and positions.score(99) == (0, 0)


def test_the_list_shows_progress_score_and_where_to_start(monkeypatch, tmp_path, capsys):
    from dplab.lessons.resume import Positions
    from dplab.lessons.terminal import list_lessons, make_console

    monkeypatch.setenv("DPLAB_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "160")
    assert list_lessons(make_console()) == 0
    assert "Start here: dplab lesson 1" in capsys.readouterr().out
    positions = Positions.load(tmp_path / "lessons.json")
    positions.save(1, None, answers={1: ("close", False), 2: ("3", True), 4: ("0.1", True)})
    positions.save(2, 3, answers={1: ("", None)})
    assert list_lessons(make_console()) == 0
    out = capsys.readouterr().out
    row1 = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    row2 = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    assert "done" in row1 and "2/3" in row1
    assert "(resumes at step 3)" in row2 and "3/" in row2 and "0/1" in row2
    assert "Continue: dplab lesson 2" in out and "resumes at step 3/" in out


# --- 4. pictures in the terminal ------------------------------------------------------------------

def _plain(renderable, width: int = 100) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def test_the_schedule_picture_is_the_spines_own_drawing_and_the_table_lists_every_transfer():
    from dplab.lessons.pictures_terminal import schedule_picture, schedule_table
    from dplab.reference.algorithms import tree
    from dplab.reference.pictures import render_rounds

    schedule = ring.reduce_scatter(4)
    drawn = _plain(schedule_picture(schedule))
    for line in render_rounds(schedule).splitlines():  # reused, line for line, not redrawn
        assert line.rstrip() in drawn
    big = tree.allreduce(12)  # past the notation's 10 ranks: the table of the same transfers
    table = _plain(schedule_picture(big), width=200)
    assert table == _plain(schedule_table(big), width=200)
    rows = [line.split() for line in table.splitlines()[1:] if line.strip()]
    assert len(rows) == len(big.rounds)
    for row, rnd in zip(rows, big.rounds):
        # each cell a transfer of the real schedule, and all of them
        drawn_moves = [f"{a} {b}" for a, b in zip(row[1::2], row[2::2])]
        assert drawn_moves == [
            f"r{t.src}→r{t.dst} c{t.chunk}{'+' if t.op == 'reduce' else '='}" for t in rnd
        ]


def test_the_bucket_timeline_puts_each_bucket_where_the_trace_has_it():
    from dplab.lessons.pictures_terminal import bucket_timeline
    from dplab.reference.trace import Event

    events = [Event(0, "backward", 0, 1000, extra={"step": 0}),
              Event(0, "bucket", 500, 700, extra={"bucket": 0, "step": 0}),
              Event(0, "bucket", 1000, 2000, extra={"bucket": 1, "step": 0}),
              Event(0, "forward", 2000, 3000, extra={"step": 1})]
    text = _plain(bucket_timeline(events, width=40))
    back = next(line for line in text.splitlines() if line.strip().startswith("backward"))
    comm = next(line for line in text.splitlines() if line.strip().startswith("all-reduce"))
    bar, lane = back.split("│")[1], comm.split("│")[1]
    assert bar == "█" * 20 + " " * 20                       # backward: the first half of 2,000 ns
    assert lane.index("0") == 10 and lane.count("0") == 4   # bucket 0 at 500-700 ns: under backward
    assert lane.index("1") == 20 and lane.count("1") == 20  # bucket 1 after it
    as_dicts = [
        {"kind": e.kind, "t_start_ns": e.t_start_ns, "t_end_ns": e.t_end_ns, "extra": e.extra}
        for e in events
    ]
    # a trace read back from JSON draws the same
    assert _plain(bucket_timeline(as_dicts, width=40)) == text
    assert "no backward or bucket events" in _plain(bucket_timeline([]))


def test_memory_bars_share_one_scale_and_name_their_parts():
    from dplab.lessons.pictures_terminal import memory_bars

    text = _plain(
        memory_bars(
            {
                "replica": {"params": 4 << 20, "grads": 4 << 20, "optimizer": 8 << 20},
                "ZeRO-3": {
                    "params": 1 << 20,
                    "grads": 1 << 20,
                    "optimizer": 2 << 20,
                    "activations": 0,
                },
            },
            width=40,
        )
    )
    replica = next(line for line in text.splitlines() if line.startswith("replica"))
    zero = next(line for line in text.splitlines() if line.startswith("ZeRO-3"))
    assert replica.count("█") == 10 and replica.count("▓") == 10 and replica.count("▒") == 20
    assert zero.count("█") == 2 and zero.count("▒") == 5 and "░" not in zero   # 2.5 and 5 columns
    assert "16 MiB" in replica and "4 MiB" in zero
    # only parts that are there
    assert "█ params" in text and "activations" not in text


def test_a_steps_terminal_picture_is_drawn_after_its_text(monkeypatch, tmp_path):
    from dplab.lessons.pictures_terminal import schedule_picture
    from dplab.lessons.terminal import run_lesson

    screen, console = _terminal(monkeypatch, tmp_path, "\n")
    step = Step("Ring", "the ring at p={p}", lambda lab: {"p": 3}, (Check("ok", lambda f: True),),
                picture=lambda f: schedule_picture(ring.reduce_scatter(f["p"])))
    assert run_lesson(Lesson(99, "fake", "Fake", "For the tests.", (step,)), console=console) == 0
    text = screen.getvalue()
    assert text.index("the ring at p=3") < text.index("round 0") < text.index("after round 1")


# Every lesson step's own terminal picture is drawn from its real facts at 80 columns in
# tests/test_lesson_notebooks.py (_check_outcomes), on the notebook's run of the step: not
# here, where it ran every step with a picture a second time.


# --- 6. dplab lesson watch ------------------------------------------------------------------------

def test_watch_checks_at_start_and_again_once_per_settled_save(tmp_path):
    import threading
    import time

    from dplab.lessons.watch import snapshot, watch

    (tmp_path / "ring.py").write_text("v1")
    (tmp_path / "__pycache__").mkdir()
    calls: list[float] = []

    def check() -> int:
        calls.append(time.monotonic())
        if len(calls) == 1:  # the learner saves three times in a burst, and a cache file changes
            def save() -> None:
                time.sleep(0.15)
                for text in ("v2", "v22", "v222"):
                    (tmp_path / "ring.py").write_text(text)
                    (tmp_path / "__pycache__" / "ring.pyc").write_text(text)
                    time.sleep(0.02)
            threading.Thread(target=save, daemon=True).start()
        return len(calls)

    start = time.monotonic()
    assert watch(check, tmp_path, poll_s=0.02, debounce_s=0.1, max_checks=2) == 2
    assert time.monotonic() - start < 5
    assert calls[1] - calls[0] >= 0.15 + 0.1   # after the save and the quiet, once for the burst
    assert list(snapshot(tmp_path)) == ["ring.py"]   # caches are not the learner's code


def test_dplab_lesson_watch_rechecks_on_save_and_ctrl_c_exits_130(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    work = tmp_path / "work"
    env = {**os.environ, "DPLAB_HOME": str(tmp_path), "COLUMNS": "100"}
    env.pop("NO_COLOR", None)
    dplab = [sys.executable, "-m", "dplab.backends.cli", "lesson"]
    subprocess.run(
        [*dplab, "init", str(work)], env=env, check=True, capture_output=True, timeout=60
    )
    proc = subprocess.Popen([*dplab, "watch", "2", str(work), "--poll", "0.05"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    out = ""
    try:
        def wait_for(text: str, count: int) -> None:
            nonlocal out
            deadline = time.monotonic() + 90
            while out.count(text) < count:
                assert time.monotonic() < deadline and proc.poll() is None, out
                time.sleep(0.05)
                out = "".join(lines)

        wait_for("watching", 1)
        assert "check 1 · lesson 2" in out and "of lesson 2 pass" in out
        solutions = Path(__file__).parents[1] / "lessons" / "exercises" / "solutions"
        solution = solutions / "ring_reduce_scatter.py"
        (work / "ring_reduce_scatter.py").write_text(solution.read_text())
        wait_for("watching", 2)
        assert "check 2 · lesson 2" in out
        second = out[out.index("check 2 · lesson 2"):]
        assert (
            "ring_reduce_scatter  ✓ passed" in second or "ring_reduce_scatter  ok passed" in second
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read().strip().endswith("interrupted")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_requests():
    from dplab.lessons.command import parse_request

    assert (
        parse_request(["watch", "2"]).path is None
        and parse_request(["watch", "2", "d"]).path == "d"
    )
    assert parse_request(["watch", "2", "d"], poll=0.1).poll == 0.1
    with pytest.raises(ConfigError, match=r"usage: dplab lesson watch N \[DIR\]"):
        parse_request(["watch"])
    with pytest.raises(ConfigError, match="--poll goes with watch"):
        parse_request(["check", "2"], poll=0.1)


def test_what_a_run_prints_is_shown_with_the_result_never_before_the_answer(monkeypatch, tmp_path):
    from dplab.lessons.terminal import run_lesson

    def noisy(lab):
        print("rank 0 sent 1,572,864 bytes")   # the answer, printed by the run asked about
        return {"p": 4, "n_bytes": 1 << 20, "sent": 1_572_864, "secret": "SECRET-RESULT"}

    screen, console = _terminal(monkeypatch, tmp_path, "2\n\n")
    les = Lesson(99, "fake", "Fake", "For the tests.", (_quiz(noisy),))   # asked after its run
    assert run_lesson(les, console=console) == 0
    text = screen.getvalue()
    assert text.index("Predict first") < text.index("not quite") < text.index("rank 0 sent "
                                                                              "1,572,864 bytes")
    with Lab() as lab:
        assert run_step(_quiz(noisy), lab).printed == "rank 0 sent 1,572,864 bytes\n"


@pytest.mark.parametrize(("value", "rel_tol", "want"), [
    (65504.0, 1e-3, "65,504"),          # float16's max: not 65,500
    (96695.3, 0.05, "96,695"),          # the integer part is never rounded
    (2_031_552, 0.02, "2,031,552"),     # an int in full, with separators
    (0.33658, 0.1, "0.337"),
    (0.1, 0.0, "0.1"),
    (1 / 3, 0.0, "0.333333333333"),     # exact: within the judge's own 1e-12
])
def test_the_answer_is_printed_exactly_as_it_is_judged(value, rel_tol, want):
    step = Predict("?", "x", rel_tol=rel_tol)
    verdict = step.judge({"x": value}, "")
    assert verdict.expected == want
    assert step.judge({"x": value}, want).correct   # the printed answer is itself a right reply


def test_booleans_and_zero_distances_read_as_words():
    facts = {"ok": True, "no": False, "d": 0.0, "e": 1.4e-16}
    assert fill("identical ({ok}), {no:yesno}/{ok:yesno}, within {d:diff} and {e:diff}", facts) == \
        "identical (checked), no/yes, within 0 (exactly) and 1.4e-16"


def _long_lines(lab):
    x = 1  # a comment long enough that a terminal of eighty columns would have to wrap it onto the next line  # noqa: E501
    return {"x": x}


def test_prose_comes_first_then_code_never_wrapped_and_the_title_whole(monkeypatch, tmp_path):
    from dplab.lessons.terminal import run_lesson

    screen, console = _terminal(monkeypatch, tmp_path, "")
    title = ("A title far too long to fit in the rule of a terminal that is only one hundred "
             "columns wide, kept whole")
    les = Lesson(99, "fake", "Fake", "For the tests.", (Step(title, "PROSE {x}", _long_lines),))
    assert run_lesson(les, pause=False, console=console) == 0
    text = screen.getvalue()
    assert "kept whole" in text
    assert text.index("PROSE 1") < text.index("def _long_lines")
    (line,) = [ln for ln in text.splitlines() if "a comment long enough" in ln]
    assert (
        line.startswith("    x = 1") and line.rstrip().endswith("…") and len(line.rstrip()) == 100
    )
    assert "next line" not in text   # cut, not wrapped onto an unindented line


def _rank_writes(comm, text):
    import os
    os.write(2, text)                       # a rank's own file descriptor 2, as a library's warning


def _warns(lab):
    import sys
    print("on stderr", file=sys.stderr)
    lab.world(1).run(_rank_writes, b"from a rank\n")
    return {"n": 1}


def test_what_a_step_writes_to_stderr_is_kept_with_its_result(capfd):
    with Lab() as lab:
        out = run_step(Step("Noisy", "n={n}", _warns), lab)
    assert "on stderr" in out.printed and "from a rank" in out.printed
    assert "from a rank" not in capfd.readouterr().err


def test_a_closed_lab_runs_steps_again(capfd):
    lab = Lab()
    lab.close()                             # the app closes a lesson's lab and may use it again
    try:
        assert "from a rank" in run_step(Step("Noisy", "n={n}", _warns), lab).printed
    finally:
        lab.close()


def _fails(lab):
    lab.world(1).run(_rank_writes, b"rank 1: Traceback ... ValueError\n")
    raise ValueError("the step broke")


def test_a_failed_steps_stderr_is_not_swallowed(capfd):
    with Lab() as lab, pytest.raises(ValueError, match="the step broke"):
        run_step(Step("Broken", "x", _fails), lab)
    assert "rank 1: Traceback" in capfd.readouterr().err
