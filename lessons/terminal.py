"""``dplab lesson``: step through a lesson in the terminal, on the real engine.

    dplab lesson                 # the lessons: steps, estimated time, what each needs
    dplab lesson 1               # Enter: next step, b: back, h: hint, q: quit (resumes later)
    dplab lesson 1 --step 3      # start at step 3
    dplab lesson 1 --no-pause    # straight through, reading nothing: exit 1 naming a failed claim
    dplab lesson init DIR        # copy the exercises' stubs; then: dplab lesson check 2 DIR

A "predict first" step runs first (its facts hold the answer), asks, reads the reply, judges it
(``Predict.judge``) and only then shows what happened. The position is saved whenever a step is
shown and on q, Ctrl-C or end of input (``lessons/resume.py``); a step that takes more than a
second shows a progress bar with an ETA from the time it took here last time.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from dplab.backends.cli.table import styled
from dplab.lessons import lesson as lesson_number
from dplab.lessons import lessons, render
from dplab.lessons.resume import Positions
from dplab.lessons.runner import Lab, StepOutcome, missing_needs, run_step
from dplab.lessons.step import Lesson, Verdict, fill
from dplab.lessons.ticker import Ticker
from dplab.reference.errors import ConfigError, DplabError

__all__ = ["make_console", "list_lessons", "progress", "run", "run_lesson", "init", "check",
           "watch", "KEYS"]

KEYS = "Enter: next · b: back · h: hint · q: quit"


def make_console(file: TextIO | None = None) -> Console:
    """Colour on a terminal without ``NO_COLOR``; plain text (no escape codes at all, no trailing
    blanks from rich's padding) when piped: 80 columns, or ``$COLUMNS``."""
    file = file or sys.stdout
    colour = styled(file)
    try:
        tty = file.isatty()
    except (AttributeError, ValueError):
        tty = False
    return Console(file=file if tty else _Trimmed(file), force_terminal=tty, no_color=not colour,
                   color_system="auto" if colour else None, highlight=False, emoji=False)


class _Trimmed:
    """A text stream that drops the spaces rich pads each line with before the newline."""

    def __init__(self, file: TextIO) -> None:
        self.file = file

    def write(self, text: str) -> int:
        self.file.write(re.sub(r"[ \t]+\n", "\n", text))
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.file.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.file, "encoding", None) or "utf-8"


def list_lessons(console: Console | None = None) -> int:
    """The table of lessons, with a line on how to start one."""
    console = console or make_console()
    positions = Positions.load()
    _warn(console, positions.warning)
    needs = [(les, missing_needs(les)) for les in lessons()]
    rows = [(les, missing, render.estimate_seconds(les, positions.seconds(les.number), not missing),
             progress(positions, les.number)) for les, missing in needs]
    console.print(render.lessons_table(rows))
    console.print()
    console.print(render.start_here([(les, missing, p) for les, missing, _, p in rows]))
    console.print(Text.assemble("\n", ("dplab lesson N", "cyan"), " steps through lesson N (",
                                KEYS, "); ", ("--step K", "cyan"), " starts at step K; ",
                                ("--no-pause", "cyan"), " runs it straight through."))
    console.print(Text.assemble("Exercises: ", ("dplab lesson init DIR", "cyan"), " copies them; ",
                                ("dplab lesson watch N DIR", "cyan"),
                                " checks lesson N's again on every save."))
    return 0


class _Quit(Exception):
    """``q`` (or the end of input) at the answer prompt: stop here, nothing answered."""


def progress(positions: Positions, number: int) -> render.Progress:
    """Lesson ``number``'s progress and prediction score, from the saved positions."""
    right, asked = positions.score(number)
    return render.Progress(positions.step(number), positions.seen(number), positions.done(number),
                           right, asked)


@dataclass
class _Session:
    lesson: Lesson
    console: Console
    pause: bool
    positions: Positions
    outcomes: dict[int, StepOutcome] = field(default_factory=dict)
    answers: dict[int, Verdict | None] = field(default_factory=dict)
    replies: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    hints_shown: dict[int, int] = field(default_factory=dict)
    # the step shown now (0-based): where an interruption leaves
    at: int = 0

    def save(self, step: int | None) -> None:
        if self.pause:  # a script (--no-pause) leaves the learner's place alone
            answers = {i + 1: (self.replies.get(i, ""), None if v is None else v.correct)
                       for i, v in self.answers.items()}
            _warn(
                self.console, self.positions.save(self.lesson.number, step, self.seconds, answers)
            )

    def outcome(self, index: int, lab: Lab) -> StepOutcome:
        """Run step ``index`` once (going back shows the same run again)."""
        if index not in self.outcomes:
            step = self.lesson.steps[index]
            expected = self.positions.seconds(self.lesson.number).get(index + 1)
            with Ticker(self.console, f"running step {index + 1}: {step.title}", expected):
                self.outcomes[index] = run_step(step, lab, figure=False)  # figures: the app's
            self.seconds[index + 1] = self.outcomes[index].seconds
        return self.outcomes[index]

    def hint(self, index: int) -> None:
        """The next tier of help for step ``index`` (the last one again once all are shown)."""
        step = self.lesson.steps[index]
        tier = self.hints_shown.get(index, 0)
        self.console.print(render.hint_text(step, tier))
        self.hints_shown[index] = min(tier + 1, max(len(step.all_hints()) - 1, 0))

    def ask(self, index: int, question: str) -> str:
        """Ask step ``index``'s question until it gets a reply: ``h`` is a hint, ``q`` quits, Enter
        skips (the answer is shown, not judged); neither ``h`` nor ``q`` is ever an answer."""
        step, console = self.lesson.steps[index], self.console
        console.print(render.question_line(step, question))
        tiers = len(step.all_hints())
        prompt = "your answer (h: hint, Enter: show it, q: quit)> " if tiers else \
            "your answer (Enter: show it, q: quit)> "
        while True:
            try:
                reply = console.input(prompt).strip()
            except EOFError:
                console.print()
                raise _Quit from None
            if reply.lower() == "q":
                raise _Quit
            if reply.lower() == "h":
                self.hint(index)
                continue
            return reply

    def show(self, index: int, lab: Lab) -> None:
        """Predict first: a step with a question shows nothing but the question until it is answered
        (asked before the run when its inputs fill it, else after an unseen run); then the verdict,
        the result and the code. Other steps: the result (prose first), then the code."""
        step, console = self.lesson.steps[index], self.console
        console.print()
        console.print(render.step_rule(self.lesson, index))
        predicting = step.predict is not None and self.pause
        if predicting and index not in self.answers:
            if step.asks_before_run():
                reply = self.ask(index, fill(step.predict.question, step.inputs))
                out = self.outcome(index, lab)
            else:
                out = self.outcome(index, lab)
                reply = self.ask(index, out.question() or "")
            self.replies[index] = reply
            self.answers[index] = step.predict.judge(out.facts, reply) if reply else None
        elif predicting:
            out = self.outcome(index, lab)
            console.print(render.question_line(step, out.question() or ""))
        else:
            out = self.outcome(index, lab)
        if step.predict is not None:
            expected = step.predict.judge(out.facts, "").expected
            if predicting:
                console.print(render.verdict_text(self.answers[index], expected, console.encoding))
            else:
                console.print(render.question_line(step, out.question() or ""))
                console.print(Text(f"answer: {expected}", style="magenta"))
        console.print()
        for part in render.outcome_body(out, self.lesson, console.encoding):
            console.print(part)
        # the code last: after the answer (it may hold it), and after the prose that says what it
        # does
        console.print(render.code_block(step, console.width, console.encoding))

    def failed(self) -> list[str]:
        return [f"step {i + 1} ({o.step.title}): {c.claim!r} did not hold"
                for i, o in sorted(self.outcomes.items()) for c in o.checks if not c.holds]

    def score(self) -> tuple[int, int]:
        """(right, asked) over the questions met in this run."""
        return sum(v is not None and v.correct for v in self.answers.values()), len(self.answers)


def run_lesson(lesson: Lesson, step: int | None = None, pause: bool = True,
               console: Console | None = None) -> int:
    """Step through ``lesson`` (1-based ``step``; None: where the learner stopped). 0: done or quit
    with every check holding; 1: a claim did not hold (named on stderr) or a step failed to run."""
    console = console or make_console()
    missing = missing_needs(lesson)
    if missing:
        raise ConfigError(f"lesson {lesson.number} needs the {', '.join(missing)} extra: "
                          + "; ".join(render.PIP.get(m, "pip install dplab") for m in missing))
    n = len(lesson.steps)
    if step is not None and not 1 <= step <= n:
        raise ConfigError(
            f"lesson {lesson.number} has {n} steps: --step must be 1..{n}, got {step}"
        )
    positions = Positions.load()
    session = _Session(lesson, console, pause, positions)
    if step is None and pause:
        _warn(console, positions.warning)
        resumed = positions.step(lesson.number)
        if resumed is not None and 1 <= resumed <= n:
            console.print(
                Text(
                    f"Resuming lesson {lesson.number} at step {resumed}/{n} "
                    f"(dplab lesson {lesson.number} --step 1 starts over).",
                    style="yellow",
                )
            )
            step = resumed
    index = (step or 1) - 1
    console.print(Text(f"Lesson {lesson.number}: {lesson.title}", style="bold"))
    console.print(lesson.summary)
    if pause:
        console.print(Text(KEYS, style="dim"))
    with Lab() as lab:
        try:
            index = _loop(session, index, lab)
        except KeyboardInterrupt:
            session.save(session.at + 1)
            print(f"dplab lesson {lesson.number}: stopped at step {session.at + 1}/{n}; "
                  f"dplab lesson {lesson.number} resumes there", file=sys.stderr, flush=True)
            raise  # the CLI's interruptible: the ranks are stopped, one line, exit 130
        except DplabError as e:
            session.save(session.at + 1)
            print(
                f"dplab lesson {lesson.number}: step {session.at + 1} could not run: {e}",
                file=sys.stderr,
            )
            return 1
    if index < n:  # q or end of input
        session.save(index + 1)
        console.print(Text(f"Stopped at step {index + 1}/{n}: dplab lesson {lesson.number} resumes "
                           "there.",
                           style="yellow"))
    else:
        _end(session)
    for line in session.failed():
        print(f"dplab lesson {lesson.number}: {line}", file=sys.stderr)
    return 1 if session.failed() else 0


def _loop(session: _Session, index: int, lab: Lab) -> int:
    """Show steps from ``index`` on; returns where it stopped (``len(steps)``: the end)."""
    n, console = len(session.lesson.steps), session.console
    while index < n:
        session.at = index
        session.save(index + 1)
        try:
            session.show(index, lab)
        except _Quit:
            return index
        if not session.pause:
            index += 1
            continue
        while True:
            try:
                key = console.input(Text(f"[{KEYS}]> ", style="dim")).strip().lower()
            except EOFError:
                console.print()
                return index
            if key in ("", "n"):
                index += 1
                break
            if key == "b":
                if index == 0:
                    console.print(Text("This is the first step.", style="yellow"))
                    continue
                index -= 1
                break
            if key == "h":
                session.hint(index)
            elif key == "q":
                return index
            else:
                console.print(Text(f"{key!r}: type Enter, b, h or q", style="yellow"))
    return index


def _end(session: _Session) -> None:
    lesson, console = session.lesson, session.console
    session.save(None)
    checks = [c for o in session.outcomes.values() for c in o.checks]
    held = sum(c.holds for c in checks)
    yes, no = render.marks(console.encoding)
    console.print()
    console.print(render.end_rule(lesson))
    console.print(Text(f"{yes if held == len(checks) else no} {held} of {len(checks)} checks held "
                       f"in the {len(session.outcomes)} steps shown.",
                       style="bold green" if held == len(checks) else "bold red"))
    right, asked = session.score()
    if asked:
        console.print(render.score_text(right, asked))
    nxt = [les for les in lessons() if les.number == lesson.number + 1]
    if nxt:
        console.print(Text.assemble("Next: ", (f"dplab lesson {nxt[0].number}", "cyan"),
                                    f" ({nxt[0].title})"))


def run(number: int, step: int | None = None, pause: bool = True) -> int:
    """``dplab lesson N``: lesson ``number`` (a bad number is a ConfigError listing the lessons)."""
    return run_lesson(lesson_number(number), step, pause)


def _exercises() -> Any:
    try:
        return importlib.import_module("dplab.lessons.exercises")
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("dplab.lessons.exercises"):
            raise
        raise ConfigError("the exercises (dplab.lessons.exercises) are not installed: "
                          "reinstall dplab with pip install -e .") from None


def init(path: str | Path) -> int:
    """``dplab lesson init DIR``: copy the exercises' stubs into DIR and say what comes next."""
    console = make_console()
    # "": refused, not "."
    written = _exercises().init_dir(path if not str(path).strip() else Path(path))
    for file in written:
        console.print(Text.assemble("wrote ", (str(file), "cyan")))
    console.print(Text.assemble(f"{len(written)} exercise files in {path}: fill them in, then ",
                                ("dplab lesson check N " + str(path), "cyan"), " for lesson N."))
    return 0


def check(number: int, path: str | Path | None = None) -> int:
    """``dplab lesson check N [DIR]``: run the learner's code; 0 when every exercise passes."""
    console = make_console()
    reports = _exercises().check(number, None if path is None else Path(path))
    for report in reports:
        if getattr(report, "output", "").strip():
            console.print(Text(f"{report.name} printed:", style="dim"))
            console.print(Text(report.output.rstrip()))
    console.print(render.reports_table(reports, console.encoding))
    passed = sum(bool(r.passed) for r in reports)
    console.print(Text(f"{passed} of {len(reports)} exercises of lesson {number} pass.",
                       style="bold green" if passed == len(reports) else "bold red"))
    return 0 if passed == len(reports) else 1


def watch(number: int, path: str | Path | None = None, poll_s: float | None = None) -> int:
    """``dplab lesson watch N [DIR]``: check lesson ``number``'s exercises now and again whenever a
    file in DIR is saved, until Ctrl-C (KeyboardInterrupt: the CLI's exit 130)."""
    from dplab.lessons import watch as watching

    exercises = _exercises()
    folder = exercises.exercise_folder(path if path is not None else ".")
    exercises.check_settings()  # before the first check's header: a bad setting is one line, exit 2
    console = make_console()
    rounds = [0]

    def once() -> int:
        rounds[0] += 1
        console.print(
            Rule(
                Text(f"check {rounds[0]} · lesson {number} · {time.strftime('%H:%M:%S')}"),
                align="left",
                style="dim",
            )
        )
        return check(number, folder)

    def waiting() -> None:
        console.print(Text.assemble("watching ", (str(folder), "cyan"),
                                    ": save a file to check again, Ctrl-C to stop", style="dim"))

    return watching.watch(
        once, folder, poll_s if poll_s is not None else watching.POLL_S, on_wait=waiting
    )


def _warn(console: Console, warning: str | None) -> None:
    if warning:
        print(f"dplab lesson: warning: {warning}", file=sys.stderr, flush=True)
