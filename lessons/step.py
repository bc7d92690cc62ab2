"""What a lesson is made of: steps that run the real engine and prove what they say.

A step is data. ``run(lab)`` runs a small piece of the real engine and returns its *facts* (a
dict: byte counts, losses, times, schedules, traces). Everything the learner reads is filled
from those facts: the text (``"rank 0 sends {sent:,} bytes"``), the checks (each a sentence and a
predicate over the facts), the figure (a builder from ``viz/``), the "predict first" question
and its answer. Nothing is typed in twice, so a step whose claim stops being true fails CI::

    Step(
        title="Bytes on the wire",
        text="At p={p}, rank 0 sends {sent:,} bytes: 2(p-1)/p of the {n_bytes:,}.",
        run=ring_bytes,                      # def ring_bytes(lab) -> {"p": 4, "sent": ..., ...}
        checks=(Check("rank 0 sends 2(p-1)/p · n bytes", lambda f: f["sent"] == f["formula"]),),
        predict=Predict("How many bytes does rank 0 send at p={p} for {n_bytes:,} bytes?", "sent"),
    )

The terminal (``lessons/terminal.py``) and the app's Lessons page render the same steps through
``lessons/runner.py``.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["Facts", "Check", "Predict", "Verdict", "Explore", "Step", "Lesson", "fill"]

Facts = dict[str, Any]


def fill(template: str, facts: Mapping[str, Any]) -> str:
    """``template.format_map(facts)``, with an error that names the missing fact."""
    try:
        return template.format_map(facts)
    except KeyError as e:
        raise ConfigError(f"the text {template[:60]!r}... needs the fact {e.args[0]!r}, which the step's "
                          f"run did not return (it returned {sorted(facts)})") from None


@dataclass(frozen=True)
class Check:
    """One claim of a step: the sentence the learner reads, and what makes it true."""

    claim: str                                 # filled from the facts like the text
    holds: Callable[[Facts], bool]


@dataclass(frozen=True)
class Verdict:
    correct: bool
    expected: str                              # the measured answer, as the learner reads it
    message: str                               # one line: right, or how far off and why


@dataclass(frozen=True)
class Predict:
    """A "predict first" question: asked before the step shows its result, answered by a fact.

    Numeric answers are right within ``rel_tol`` (0: exactly, after rounding to an integer when
    the fact is one); with ``choices`` the reply is one of them (case and spaces ignored).
    """

    question: str                              # filled from the facts (only inputs belong here)
    answer: str                                # the fact that answers it
    rel_tol: float = 0.0
    unit: str = ""
    choices: tuple[str, ...] = ()

    def expected(self, facts: Facts) -> Any:
        if self.answer not in facts:
            raise ConfigError(f"the question's answer is the fact {self.answer!r}, which the run did not "
                              f"return (it returned {sorted(facts)})")
        return facts[self.answer]

    def judge(self, facts: Facts, reply: str) -> Verdict:
        truth = self.expected(facts)
        shown = f"{truth:,}" if isinstance(truth, int) else str(truth)
        shown += f" {self.unit}" if self.unit else ""
        reply = reply.strip()
        if self.choices:
            ok = _norm(reply) == _norm(str(truth))
            return Verdict(ok, shown, "right" if ok else f"not quite: it is {shown}")
        guess = _number(reply)
        if guess is None:
            said = reply if len(reply) <= 40 else f"{reply[:40]}..."
            return Verdict(False, shown, f"{said!r} is not a number; the answer is {shown}")
        ok = math.isclose(guess, float(truth), rel_tol=self.rel_tol, abs_tol=1e-12)
        if ok:
            return Verdict(True, shown, f"right: {shown}")
        ratio = guess / float(truth) if truth else math.inf
        return Verdict(False, shown, f"not quite: it is {shown} (you said {reply}, {ratio:.3g}x that)")


def _norm(s: str) -> str:
    return "".join(s.lower().split())


_SCALE = {"k": 1e3, "m": 1e6, "g": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6,
          "gb": 1e9, "b": 1, "%": 0.01, "x": 1, "bytes": 1}
_SUFFIXES = sorted(_SCALE, key=len, reverse=True)
_MAX_REPLY = 100  # characters: no number a person types is longer


def _number(reply: str) -> float | None:
    """``1,572,864``, ``1.5e6``, ``1.5M``, ``1.5 MiB``, ``3/4``: what a person types for a number.

    At most one unit suffix is read, so a reply of any length is judged in one pass (a digit
    followed by thousands of letters is simply not a number); infinities and NaN are not numbers."""
    s = _norm(reply[:4 * _MAX_REPLY + 1]).replace(",", "").replace("_", "")
    if not s or len(s) > _MAX_REPLY:
        return None
    scale = 1.0
    for suffix in _SUFFIXES:
        if s.endswith(suffix) and s[: -len(suffix)]:
            s, scale = s[: -len(suffix)], _SCALE[suffix]
            break
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            value = float(a) / float(b)
        else:
            value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    value *= scale
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Explore:
    """A deep link: the app page that explores the step further, with the step's parameters."""

    page: str                                  # the app page: "collectives", "cost", "training", "runs"
    params: Callable[[Facts], dict[str, Any]] | None = None

    def query(self, facts: Facts) -> dict[str, str]:
        return {k: str(v) for k, v in (self.params(facts) if self.params else {}).items()}


@dataclass(frozen=True)
class Step:
    title: str
    text: str                                  # markdown; {fields} filled from the facts
    run: Callable[..., Facts]                  # run(lab) -> facts; its source is the code shown
    checks: tuple[Check, ...] = ()
    figure: Callable[[Facts], Any] | None = None   # facts -> plotly figure (a viz/ builder)
    predict: Predict | None = None
    hint: str = ""
    try_this: str = ""                         # a command or a change to explore
    explore: Explore | None = None
    exercise: str = ""                         # the name of an exercise (lessons/exercises) it asks for
    teaches: tuple[str, ...] = ()              # keys of lessons/coverage.py CONCEPTS

    def code(self) -> str:
        """The code the learner sees: the source of ``run`` itself, so it cannot drift, after the
        public functions of its module that it calls (a rank's job must live at module level)."""
        module = inspect.getmodule(self.run)
        called = [getattr(module, name) for name in self.run.__code__.co_names
                  if not name.startswith("_") and inspect.isfunction(getattr(module, name, None))
                  and getattr(module, name).__module__ == self.run.__module__]
        return "\n\n\n".join(textwrap.dedent(inspect.getsource(f)).strip() for f in [*called, self.run])


@dataclass(frozen=True)
class Lesson:
    number: int
    slug: str                                  # the module's short name, e.g. "replicas"
    title: str
    summary: str                               # one line: what the learner will know after it
    steps: tuple[Step, ...]
    needs: tuple[str, ...] = ()                # extras beyond the core: "mpi", "torch", "viz"

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError(f"lesson {self.number} ({self.slug}) has no steps")
