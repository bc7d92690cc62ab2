"""One lesson step as rich renderables: what ``dplab lesson`` prints, pieces the terminal composes.

    from rich.console import Console
    from dplab.lessons.render import step_rule, code_block, outcome_body
    console = Console()
    console.print(step_rule(lesson, 0), *outcome_body(outcome, lesson, "utf-8"), code_block(step))

Pure functions, no input and no I/O: the interaction (keys, questions, resume) is in
``lessons/terminal.py``. Everything is readable at 80 columns and as plain text when piped (the
Console decides; nothing here writes escape codes itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from rich.markdown import Markdown
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from dplab.lessons.runner import StepOutcome
from dplab.lessons.step import Lesson, Step, Verdict

__all__ = ["marks", "step_rule", "end_rule", "code_block", "question_text", "question_line",
           "verdict_text", "outcome_body", "hint_text", "explore_link", "estimate_seconds",
           "lessons_table", "reports_table", "score_text", "start_here", "Progress", "PIP"]

PIP = {"mpi": "pip install 'dplab[mpi]'", "torch": "pip install 'dplab[torch]'",
       "viz": "pip install 'dplab[viz]'"}
READ_WORDS_PER_S = 3.0        # ~180 words a minute, for the listing's estimate
READ_CODE_LINE_S = 2.0
ANSWER_S = 30.0               # thinking about a "predict first" question
UNKNOWN_RUN_S = 2.0           # a step never run here: a typical small run on the local backend


def marks(encoding: str) -> tuple[str, str]:
    """The marks for a claim that holds and one that does not (ASCII where the output cannot
    UTF-8)."""
    return ("✓", "✗") if encoding.lower().replace("-", "").startswith("utf") else ("ok", "X")


def step_rule(lesson: Lesson, index: int) -> Any:
    """``Lesson 1 · step 2/4 · Sharding the global batch`` as a rule across the screen; a title too
    long for the rule is printed whole (folded) above a plain rule, never cut short."""
    step = lesson.steps[index]
    title = Text(f"Lesson {lesson.number} · step {index + 1}/{len(lesson.steps)} · {step.title}",
                 style="bold")
    return _TitleRule(title)


class _TitleRule:
    """A rule with its title in it when the title fits the width, else the title's lines then a
    rule."""

    def __init__(self, title: Text) -> None:
        self.title = title

    def __rich_console__(self, console: Any, options: Any) -> Any:
        if len(self.title.plain) + 6 <= options.max_width:
            yield Rule(self.title, align="left", style="cyan")
        else:
            yield Text(self.title.plain, style="bold cyan", overflow="fold")
            yield Rule(style="cyan")


def end_rule(lesson: Lesson) -> Rule:
    return Rule(Text(f"End of lesson {lesson.number} · {lesson.title}", style="bold"), align="left",
                style="cyan")


def code_block(step: Step, width: int = 80, encoding: str = "utf-8") -> Syntax:
    """The code the step runs (``Step.code``), highlighted in the terminal's own colours. Never
    wrapped (a wrapped comment lands unindented, as if it were code): a line wider than ``width``
    is cut, ending in an ellipsis."""
    more = "…" if encoding.lower().replace("-", "").startswith("utf") else "~"
    lines = [
        line if len(line) <= width else line[: width - 1] + more
        for line in step.code().splitlines()
    ]
    return Syntax(
        "\n".join(lines), "python", theme="ansi_dark", background_color="default", word_wrap=False
    )


def question_text(outcome: StepOutcome) -> Text:
    """The "predict first" question of a step that has run, with its choices when it has them."""
    return question_line(outcome.step, outcome.question() or "")


def question_line(step: Step, question: str) -> Text:
    """``Predict first: <question>`` (already filled), with its choices or unit."""
    predict = step.predict
    text = Text("Predict first: ", style="bold magenta")
    text.append(question)
    if predict is not None and predict.choices:
        text.append(f" ({' / '.join(predict.choices)})", style="magenta")
    elif predict is not None and predict.unit:
        text.append(f" (in {predict.unit})", style="magenta")
    return text


def verdict_text(verdict: Verdict | None, expected: str, encoding: str) -> Text:
    """``✓ right: 3`` / ``✗ not quite: it is identical`` / no answer given: the measured answer."""
    yes, no = marks(encoding)
    if verdict is None:
        return Text(f"(no answer) the measurement says: {expected}", style="magenta")
    return Text(f"{yes if verdict.correct else no} {verdict.message}",
                style="bold green" if verdict.correct else "bold red")


def score_text(right: int, asked: int) -> Text:
    """``Predictions: 2 of 3 right.`` at the end of a lesson."""
    return Text(f"Predictions: {right} of {asked} right.", style="bold")


def _checks_table(outcome: StepOutcome, encoding: str) -> Table:
    yes, no = marks(encoding)
    table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False, expand=False)
    table.add_column("mark", no_wrap=True)
    table.add_column("claim", overflow="fold")
    for check in outcome.checks:
        mark = Text(f"{yes} holds" if check.holds else f"{no} FAILED",
                    style="green" if check.holds else "bold red")
        table.add_row(mark, check.claim)
    return table


def explore_link(step: Step, facts: dict[str, Any]) -> str | None:
    """The app page that explores the step, with its parameters: ``dplab app`` then this path."""
    if step.explore is None:
        return None
    query = urlencode(step.explore.query(facts))
    return f"/{step.explore.page}" + (f"?{query}" if query else "")


def outcome_body(outcome: StepOutcome, lesson: Lesson, encoding: str) -> list[Any]:
    """What the step showed and proved: its text, the checks with a mark each, then where to go
    next."""
    step = outcome.step
    parts: list[Any] = [Markdown(outcome.text)]
    if outcome.printed.strip():
        parts += [Text("The run printed:", style="dim"), Text(outcome.printed.rstrip())]
    parts += [
        Text(f"Checks ({outcome.seconds:.1f} s run):", style="bold"),
        _checks_table(outcome, encoding),
    ]
    if step.picture is not None:
        parts.append(step.picture(outcome.facts))
    if step.figure is not None:
        parts.append(Text.assemble(("figure: ", "bold"), "open the Lessons page in ",
                                   ("dplab app", "cyan"), f" (lesson {lesson.number})"))
    if step.try_this:
        parts.append(Text.assemble(("try this: ", "bold"), (step.try_this, "cyan")))
    link = explore_link(step, outcome.facts)
    if link:
        parts.append(
            Text.assemble(("explore: ", "bold"), ("dplab app", "cyan"), ", page ", (link, "cyan"))
        )
    if step.exercise:
        parts.append(Text.assemble(("exercise: ", "bold"), f"{step.exercise}: ",
                                   ("dplab lesson init DIR", "cyan"), ", then ",
                                   (f"dplab lesson check {lesson.number} DIR", "cyan")))
    return parts


def hint_text(step: Step, tier: int = 0) -> Text:
    """Hint ``tier`` (from 0) of the step's ``all_hints``, numbered when there are several."""
    hints = step.all_hints()
    if not hints:
        return Text.assemble(("hint: ", "bold yellow"), "this step has no hint")
    tier = min(max(tier, 0), len(hints) - 1)
    label = f"hint {tier + 1}/{len(hints)}: " if len(hints) > 1 else "hint: "
    return Text.assemble((label, "bold yellow"), hints[tier])


def estimate_seconds(lesson: Lesson, run_seconds: dict[int, float], code: bool = True) -> float:
    """A lesson's length for a learner: reading its text and code, the questions, and the runs
    (the times measured here last time, else ``UNKNOWN_RUN_S`` a step). ``code=False`` leaves the
    code out: where the lesson's extras are missing, the code it shows may not import."""
    total = 0.0
    for number, step in enumerate(lesson.steps, 1):
        words = len(step.text.split()) + sum(len(c.claim.split()) for c in step.checks)
        lines = len(step.code().splitlines()) if code else 0
        total += words / READ_WORDS_PER_S + READ_CODE_LINE_S * lines
        total += (ANSWER_S if step.predict else 0.0) + run_seconds.get(number, UNKNOWN_RUN_S)
    return total


@dataclass(frozen=True)
class Progress:
    """What the learner did in one lesson (from ``lessons/resume.py``)."""

    # the step it resumes at; None: not started or finished
    resume: int | None = None
    seen: int = 0                              # the furthest step shown
    done: bool = False                         # reached the end at least once
    right: int = 0                             # predictions right ...
    asked: int = 0                             # ... of those asked


def _progress_cell(lesson: Lesson, progress: Progress) -> Text:
    if progress.done:
        return Text("done", style="green")
    if progress.seen:
        return Text(f"{progress.seen}/{len(lesson.steps)}", style="yellow")
    return Text("-")


def lessons_table(rows: Sequence[tuple[Lesson, list[str], float, Any]]) -> Table:
    """``dplab lesson``: one row per (lesson, missing extras, estimated seconds, progress); the
    progress is a ``Progress`` or, as before, the step it resumes at (or None)."""
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("lesson", overflow="fold")
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("progress", justify="right", no_wrap=True)
    table.add_column("score", justify="right", no_wrap=True)
    table.add_column("needs", overflow="fold")
    for lesson, missing, seconds, progress in rows:
        if not isinstance(progress, Progress):
            progress = Progress(resume=progress, seen=progress or 0)
        title = Text(lesson.title)
        if progress.resume:
            title.append(f" (resumes at step {progress.resume})", style="yellow")
        needs = Text(", ".join(lesson.needs) or "-")
        for extra in missing:
            needs.append(f"\n{extra} missing: {PIP.get(extra, 'pip install dplab')}", style="red")
        score = f"{progress.right}/{progress.asked}" if progress.asked else "-"
        table.add_row(
            str(lesson.number),
            title,
            str(len(lesson.steps)),
            f"~{max(1, round(seconds / 60))} min",
            _progress_cell(lesson, progress),
            score,
            needs,
        )
    return table


def start_here(rows: Sequence[tuple[Lesson, list[str], Progress]]) -> Text:
    """Where to go next: the lesson in progress, else the first not finished whose extras are here,
    else the first lesson (all done: start again anywhere)."""
    started = [(les, p) for les, missing, p in rows if p.resume and not missing]
    if started:
        les, p = started[0]
        return Text.assemble(("Continue: ", "bold"), (f"dplab lesson {les.number}", "cyan"),
                             f" ({les.title}) resumes at step {p.resume}/{len(les.steps)}.")
    todo = [les for les, missing, p in rows if not p.done and not missing]
    if todo:
        first = all(not p.seen and not p.done for _, _, p in rows)
        return Text.assemble(("Start here: " if first else "Next: ", "bold"),
                             (f"dplab lesson {todo[0].number}", "cyan"), f" ({todo[0].title}).")
    return Text.assemble(("Every lesson done. ", "bold green"), "Run any again, or try the "
                                                                "exercises: ",
                         ("dplab lesson init DIR", "cyan"), ".")


def reports_table(reports: Sequence[Any], encoding: str) -> Table:
    """``dplab lesson check``: one row per exercise report (``.name``, ``.passed``,
    ``.message``)."""
    yes, no = marks(encoding)
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    table.add_column("exercise", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("what the check found", overflow="fold")
    for r in reports:
        table.add_row(r.name, Text(f"{yes} passed" if r.passed else f"{no} failed",
                                   style="green" if r.passed else "bold red"),
                      Text(r.message))  # plain text: a quoted `params[a:b]` is not rich markup
    return table
