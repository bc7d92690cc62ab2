"""``dplab lesson``: the step-through lessons from the command line.

    dplab lesson                      # the lessons: steps, estimated time, what each needs
    dplab lesson 1                    # step through lesson 1 (resumes where you stopped)
    dplab lesson 1 --step 3           # from step 3
    dplab lesson 1 --no-pause         # straight through without reading input (scripts, CI)
    dplab lesson init DIR             # copy the exercises' stubs into DIR
    dplab lesson check 2 [DIR]        # run your code for lesson 2's exercises (DIR: default here)
    dplab lesson watch 2 [DIR]        # check again every time a file in DIR is saved (Ctrl-C stops)
    dplab lesson notebooks DIR        # write one Jupyter notebook per lesson into DIR

This file only parses and dispatches; ``dplab.lessons.terminal`` renders. Imports run down the
house (backends < lessons), so the command line finds ``add_lesson_parser`` by its entry point
(``dplab.commands`` in pyproject.toml) instead of importing it, and the terminal's modules load
only when a lesson runs. Bad arguments are one line on stderr and exit code 2, like every
``dplab`` command.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

from dplab.backends.cli.args_optim import positive_int
from dplab.backends.launch.interrupt import interruptible
from dplab.backends.launch.world import BackendUnavailable
from dplab.reference.errors import ConfigError

__all__ = ["add_lesson_parser", "parse_request", "run_lesson_command", "LessonRequest"]

USAGE = "N | init DIR | check N [DIR] | watch N [DIR] | notebooks DIR"


def add_lesson_parser(
    sub: Any, formatter_class: type[argparse.HelpFormatter]
) -> argparse.ArgumentParser:
    """Register ``dplab lesson`` on the subparsers ``sub``; the command line finds this function by
    its entry point (``dplab.commands``).

    Args:
        sub: the ``add_subparsers()`` of dplab's parser.
        formatter_class: the command line's help formatter (every command's help, one style).

    Returns:
        The command's parser; a namespace it parses carries ``run``: ``run_lesson_command``.
    """
    p = sub.add_parser("lesson", help="step through a lesson on the real engine (no N: list them)",
                       formatter_class=formatter_class,
                       description=textwrap.fill(
                           "Step-through lessons: each step runs the real engine at a small size, "
                           "shows what happened and checks the claim it makes. Enter: next step, "
                           "b: back, h: hint, q: quit; a lesson resumes where you stopped "
                           "($DPLAB_HOME/lessons.json or ~/.cache/dplab/lessons.json). Without N: "
                           "the list of lessons.", 88),
                       epilog="examples:\n  dplab lesson\n  dplab lesson 1 --step 2\n"
                              "  dplab lesson 1 --no-pause > lesson1.txt\n"
                              "  dplab lesson init exercises && dplab lesson check 2 exercises\n"
                              "  dplab lesson watch 2 exercises     # re-checks on every save\n\n"
                              "check runs your code in a child process, stopped after "
                              "$DPLAB_CHECK_LIMIT_S seconds (30)\nand limited to "
                              "$DPLAB_CHECK_MEMORY_MB MiB (4096)")
    p.add_argument(
        "words",
        nargs="*",
        metavar=USAGE,
        help="a lesson number; 'init DIR' copies the exercise stubs into DIR; 'check N [DIR]' "
        "runs your exercises of lesson N (DIR: default the current directory); "
        "'watch N [DIR]' checks them again whenever a file in DIR is saved, until "
        "Ctrl-C; 'notebooks DIR' writes every lesson as a Jupyter notebook into DIR",
    )
    p.add_argument("--step", type=positive_int, metavar="K",
                   help="start lesson N at step K instead of where you stopped (default: resume)")
    p.add_argument("--no-pause", action="store_true",
                   help="run every step straight through without reading input; exit 1 naming any "
                        "claim that did not hold (default: pause after each step)")
    p.add_argument("--poll", type=_seconds, metavar="S",
                   help="with watch: look for saved files every S seconds (default 0.5)")
    p.add_argument("--repo", metavar="URL",
                   help="with notebooks: the git URL (or folder) their first cell installs dplab "
                        "from where it is missing, e.g. on Colab (default: none; the cell asks)")
    p.set_defaults(run=run_lesson_command)
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0.01 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.01 and 60 seconds, got {text}")
    return value


@dataclass(frozen=True)
class LessonRequest:
    action: str                    # "list", "run", "init", "check", "watch", "notebooks"
    number: int | None = None
    path: str | None = None
    step: int | None = None
    pause: bool = True
    poll: float | None = None
    repo: str | None = None


def _number(word: str) -> int:
    try:
        return int(word)
    except ValueError:
        raise ConfigError(
            f"expected a lesson number, got {word!r} (usage: dplab lesson {USAGE})"
        ) from None


def parse_request(words: list[str], step: int | None = None, no_pause: bool = False,
                  poll: float | None = None, repo: str | None = None) -> LessonRequest:
    """What ``dplab lesson WORDS...`` asks for; a ConfigError (one line) for what makes no sense."""
    if poll is not None and words[:1] != ["watch"]:
        raise ConfigError("--poll goes with watch: dplab lesson watch N DIR --poll S")
    if repo is not None and words[:1] != ["notebooks"]:
        raise ConfigError("--repo goes with notebooks: dplab lesson notebooks DIR --repo URL")
    if words[:1] == ["notebooks"]:
        if len(words) != 2 or step is not None or no_pause:
            raise ConfigError("usage: dplab lesson notebooks DIR [--repo URL] (DIR: the folder to "
                              "write the notebooks into)")
        return LessonRequest("notebooks", path=words[1], repo=repo)
    if words and words[0] in ("init", "check", "watch"):
        if step is not None or no_pause:
            raise ConfigError(f"--step and --no-pause go with a lesson number, not with {words[0]}")
        if words[0] == "watch":
            if len(words) not in (2, 3):
                raise ConfigError("usage: dplab lesson watch N [DIR] (N: the lesson; DIR: your "
                                  "exercises, default the current directory)")
            return LessonRequest(
                "watch", _number(words[1]), words[2] if len(words) == 3 else None, poll=poll
            )
        if words[0] == "init":
            if len(words) != 2:
                raise ConfigError("usage: dplab lesson init DIR (the folder to copy the exercise "
                                  "stubs into)")
            return LessonRequest("init", path=words[1])
        if len(words) not in (2, 3):
            raise ConfigError("usage: dplab lesson check N [DIR] (N: the lesson; DIR: your "
                              "exercises, default the current directory)")
        return LessonRequest("check", _number(words[1]), words[2] if len(words) == 3 else None)
    if len(words) > 1:
        raise ConfigError(f"one lesson at a time, got {' '.join(words)} (usage: dplab lesson "
                          f"{USAGE})")
    if not words:
        if step is not None or no_pause:
            raise ConfigError("--step and --no-pause need a lesson number: dplab lesson N --step K")
        return LessonRequest("list")
    return LessonRequest("run", _number(words[0]), step=step, pause=not no_pause)


def run_lesson_command(a: argparse.Namespace) -> int:
    """Dispatch to ``dplab.lessons.terminal``; ConfigError and a missing extra: one line, exit 2."""
    try:
        req = parse_request(a.words, a.step, a.no_pause, getattr(a, "poll", None),
                            getattr(a, "repo", None))
        if req.action == "notebooks":
            from dplab.lessons.notebook import write_notebooks  # nbformat: loaded when asked for
            written = write_notebooks(req.path, req.repo or "")
            print(f"wrote {len(written)} notebooks into {req.path}: open one in Jupyter, or "
                  "upload it to Colab")
            return 0
        from dplab.lessons import terminal  # rich, the lessons' runner: loaded when one runs
        if req.action == "list":
            return terminal.list_lessons()
        if req.action == "init":
            return terminal.init(req.path)
        if req.action == "check":
            return interruptible("dplab lesson", terminal.check, req.number, req.path)
        if req.action == "watch":
            return interruptible("dplab lesson", terminal.watch, req.number, req.path, req.poll)
        return interruptible("dplab lesson", terminal.run, req.number, req.step, req.pause)
    except (ConfigError, BackendUnavailable) as e:
        print(f"dplab lesson: error: {e}", file=sys.stderr, flush=True)
        return 2
