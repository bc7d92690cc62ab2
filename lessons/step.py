"""What a lesson is made of: steps that run the real engine and prove what they say.

A step is data. ``run(lab)`` runs a small piece of the real engine and returns its *facts* (a dict);
the text, the checks (a sentence and a predicate over the facts), the figure and the "predict
first" question are all filled from those facts, so a step whose claim stops being true fails CI::

    Step(
        title="Bytes on the wire",
        text="At p={p}, rank 0 sends {sent:,} bytes: 2(p-1)/p of the {n_bytes:,}.",
        run=ring_bytes,                      # def ring_bytes(lab) -> {"p": 4, "sent": ..., ...}
        checks=(Check("rank 0 sends 2(p-1)/p · n bytes", lambda f: f["sent"] == f["formula"]),),
        predict=Predict("How many bytes does rank 0 send at p={p} for {n_bytes:,} bytes?", "sent"),
    )

A step with a question shows nothing of its code, run or figure before the answer (asked before
the run when ``inputs`` alone fill it); ``hints`` are tiered, ``misconceptions`` name a wrong
reply's mistake. Numbers read as people read them (``{x:size}``, ``{x:times}``, ``{x:count}``,
``{ok:yesno}``, ``{d:diff}``: ``plain.py``); the terminal and the app render the same steps
(``runner.py``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import string
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dplab.lessons.plain import SPECS, answer, readable, times
from dplab.reference.errors import ConfigError

__all__ = ["Facts", "Check", "Predict", "Verdict", "Explore", "Step", "Lesson", "fill", "can_fill"]

Facts = dict[str, Any]


class _Plain(string.Formatter):
    """``str.format`` whose empty spec reads floats as people do, plus the specs of
    ``plain.SPECS``."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, bool) and not format_spec:
            # a claim's truth in prose reads as a word, never as Python's True/False
            return "checked" if value else "checked: false"
        if not format_spec:
            return readable(value)
        if format_spec == "diff":  # a distance: 0 reads as exact, not as 0.0e+00
            return "0 (exactly)" if value == 0 else f"{value:.1e}"
        if format_spec == "yesno":
            return "yes" if value else "no"
        if format_spec in SPECS:
            return SPECS[format_spec](value)
        return format(value, format_spec)


_FORMATTER = _Plain()


def fill(template: str, facts: Mapping[str, Any]) -> str:
    """``template`` with its ``{fields}`` filled from ``facts``: floats to 3 significant digits
    unless the field has a spec (``{x:.6f}``, ``{n:,}``, ``{b:size}``, ``{r:times}``); an error that
    names a missing fact."""
    try:
        return _FORMATTER.vformat(template, (), facts)
    except KeyError as e:
        raise ConfigError(f"the text {template[:60]!r}... needs the fact {e.args[0]!r}, which the "
                          f"step's run did not return (it returned {sorted(facts)})") from None


def can_fill(template: str, facts: Mapping[str, Any]) -> bool:
    """Whether every field of ``template`` is in ``facts`` (a question askable before the run)."""
    try:
        _FORMATTER.vformat(template, (), facts)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError):
        return False
    return True


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
    misconception: str = ""                    # filled: the mistake a wrong reply made, when named


@dataclass(frozen=True)
class Predict:
    """A "predict first" question: asked before the step shows its result, answered by a fact.

    Numeric answers are right within ``rel_tol`` (0: exactly, after rounding to an integer when
    the fact is one); with ``choices`` the reply is one of them (case and spaces ignored).
    ``misconceptions`` are ``(what, message)`` pairs tried in order on a wrong reply: ``what`` is a
    number (matched like the answer), a choice, or a predicate ``guess -> bool`` or
    ``(guess, facts) -> bool`` (``guess``: the reply's number, or its normalised text with
    choices); the first that matches adds its ``message`` (filled from the facts) to the verdict.
    """

    question: str                              # filled from the facts (only inputs belong here)
    answer: str                                # the fact that answers it
    rel_tol: float = 0.0
    unit: str = ""
    choices: tuple[str, ...] = ()
    misconceptions: tuple[tuple[Any, str], ...] = ()
    # what the answer is, when not plain: "simulated: ..."
    label: str = ""

    def expected(self, facts: Facts) -> Any:
        if self.answer not in facts:
            raise ConfigError(f"the question's answer is the fact {self.answer!r}, which the run "
                              f"did not return (it returned {sorted(facts)})")
        return facts[self.answer]

    def judge(self, facts: Facts, reply: str) -> Verdict:
        truth = self.expected(facts)
        # printed exactly as judged: never rounded past the tolerance
        shown = answer(truth, self.rel_tol)
        shown += f" {self.unit}" if self.unit else ""
        # the label says what the number is; facts judged without the run's others (a test's) go
        # without it
        shown += (
            f" ({fill(self.label, facts)})" if self.label and can_fill(self.label, facts) else ""
        )
        reply = reply.strip()
        if self.choices:
            ok = _norm(reply) == _norm(str(truth))
            if ok:
                return Verdict(True, shown, "right")
            return self._wrong(facts, _norm(reply), shown, f"not quite: it is {shown}")
        guess = _number(reply)
        if guess is None:
            said = reply if len(reply) <= 40 else f"{reply[:40]}..."
            return Verdict(False, shown, f"{said!r} is not a number; the answer is {shown}")
        ok = math.isclose(guess, float(truth), rel_tol=self.rel_tol, abs_tol=1e-12)
        if ok:
            return Verdict(True, shown, f"right: {shown}")
        ratio = guess / float(truth) if truth else math.inf
        said = reply if len(reply) <= 40 else f"{reply[:40]}..."
        return self._wrong(facts, guess, shown,
                           f"not quite: it is {shown} (you said {said}, {times(ratio)} that)")

    def _wrong(self, facts: Facts, guess: Any, shown: str, message: str) -> Verdict:
        """A wrong reply's verdict, naming the first misconception it matches."""
        for what, why in self.misconceptions:
            if _matches(what, guess, facts, self.rel_tol):
                named = fill(why, facts)
                return Verdict(False, shown, f"{message}: {named}", named)
        return Verdict(False, shown, message)


def _matches(what: Any, guess: Any, facts: Facts, rel_tol: float) -> bool:
    if callable(what):
        try:
            takes_facts = len(inspect.signature(what).parameters) >= 2
        except (TypeError, ValueError):
            takes_facts = False
        return bool(what(guess, facts) if takes_facts else what(guess))
    if isinstance(guess, str):
        return _norm(str(what)) == guess
    if isinstance(what, str):
        what = _number(what)
        if what is None:
            return False
    return math.isclose(guess, float(what), rel_tol=max(rel_tol, 1e-9), abs_tol=1e-12)


def _norm(s: str) -> str:
    return "".join(s.lower().split())


_SCALE = {
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "b": 1,
    "%": 0.01,
    "x": 1,
    "bytes": 1,
}
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

    # the app page: "collectives", "cost", "training", "runs"
    page: str
    params: Callable[[Facts], dict[str, Any]] | None = None

    def query(self, facts: Facts) -> dict[str, str]:
        return {k: str(v) for k, v in (self.params(facts) if self.params else {}).items()}


@dataclass(frozen=True)
class Step:
    """One step. ``show`` names the spine's code to display (functions, methods, classes, or their
    dotted names such as ``"dplab.reference.algorithms.ring.allreduce"``); without it the step
    shows its run's own source (``harness``). ``hint`` and ``hints`` are the tiers of help, in
    order. ``inputs`` are facts known before the run (a question filled from them alone is asked
    before running); the run's facts must agree with them. ``picture`` draws the step in the
    terminal (facts -> a rich renderable), as ``figure`` does in the app."""

    title: str
    text: str                                  # markdown; {fields} filled from the facts
    run: Callable[..., Facts]                  # run(lab) -> facts
    checks: tuple[Check, ...] = ()
    figure: Callable[[Facts], Any] | None = None   # facts -> plotly figure (a viz/ builder)
    predict: Predict | None = None
    hint: str = ""                             # the first tier of help (kept: most steps have one)
    try_this: str = ""                         # a command or a change to explore
    explore: Explore | None = None
    # the name of an exercise (lessons/exercises) it asks for
    exercise: str = ""
    teaches: tuple[str, ...] = ()              # keys of lessons/coverage.py CONCEPTS
    show: tuple[Any, ...] = ()                 # the spine code shown instead of the run's harness
    hints: tuple[str, ...] = ()                # further tiers of help, after ``hint``
    # facts -> rich renderable (lessons/pictures_terminal.py)
    picture: Callable[[Facts], Any] | None = None
    inputs: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def all_hints(self) -> tuple[str, ...]:
        """Every tier of help, in the order ``h`` reveals them."""
        return tuple(h for h in (self.hint, *self.hints) if h)

    def asks_before_run(self) -> bool:
        """Whether the question is filled from ``inputs`` alone (else the run happens, unseen,
        first)."""
        return self.predict is not None and can_fill(self.predict.question, self.inputs)

    def code(self) -> str:
        """The code the learner sees: the spine's source named by ``show``, else ``harness()``."""
        if not self.show:
            return self.harness()
        return "\n\n\n".join(_source(obj) for obj in self.show)

    def harness(self) -> str:
        """The source of ``run`` itself, so it cannot drift, after the public functions of its
        module that it calls (a rank's job must live at module level)."""
        module = inspect.getmodule(self.run)
        called = [getattr(module, name) for name in self.run.__code__.co_names
                  if not name.startswith("_") and inspect.isfunction(getattr(module, name, None))
                  and getattr(module, name).__module__ == self.run.__module__]
        return "\n\n\n".join(
            textwrap.dedent(inspect.getsource(f)).strip() for f in [*called, self.run]
        )


def _resolve(name: str) -> Any:
    """``"dplab.reference.train.buckets.Reducer.mark_param_as_ready"``:
    the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ConfigError(f"show names {name!r}, which does not import: give a dotted path to a "
                      "function, class or method, e.g. 'dplab.reference.algorithms.ring.allreduce'")


# a class longer than this is shown up to its first method: a listing, not a module
CLASS_LINES = 30


def _class_head(source: str) -> str:
    """A long class's docstring and fields, cut before its first method, saying what was left
    out."""
    lines = source.splitlines()
    for i, line in enumerate(lines[1:], 1):
        if line.startswith(("    def ", "    @", "    async def ")):
            left_out = "    ...  # its methods are left out here: the module named above has them"
            return "\n".join([*lines[:i], left_out])
    return source


_SECTION = re.compile(r"\s*(Args|Returns|Raises|Yields|Attributes):\s*")


def _without_contracts(source: str) -> str:
    """``source`` with its docstrings' Args/Returns/Raises sections left out: a listing shows the
    idea and the code; the contracts are for whoever calls it (``help()`` shows them)."""
    out: list[str] = []
    skipping = False
    for line in source.splitlines():
        if skipping:
            if line.strip().endswith(('"""', "'''")):
                skipping = False
                out.append(line[: len(line) - len(line.lstrip())] + line.strip()[-3:]
                           if line.strip() not in ('"""', "'''") else line)
            continue
        if _SECTION.fullmatch(line):
            skipping = True
            while out and not out[-1].strip():
                out.pop()
            continue
        out.append(line)
    return "\n".join(out)


def _source(obj: Any) -> str:
    """``obj``'s source, under a comment saying where it lives (the reader can open the file)."""
    obj = _resolve(obj) if isinstance(obj, str) else obj
    target = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        source = textwrap.dedent(inspect.getsource(target)).strip()
    except (TypeError, OSError) as e:
        raise ConfigError(f"show names {obj!r}, whose source cannot be read ({e})") from None
    source = _without_contracts(source)
    if inspect.isclass(target) and len(source.splitlines()) > CLASS_LINES:
        source = _class_head(source)
    module = getattr(inspect.getmodule(target), "__name__", "")
    qual = getattr(target, "__qualname__", getattr(target, "__name__", ""))
    return f"# {module}.{qual}\n{source}" if module else source


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
