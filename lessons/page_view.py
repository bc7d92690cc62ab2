"""What the Lessons page shows of a step, worked out without Streamlit (``page.py`` draws it).

    from dplab.lessons.page_view import check_lines, explore_link, position
    position({"lesson": "1", "step": "2"}, [1, 6], {1: 4, 6: 5}.get)  # (1, 1): lesson 1, step 2
    check_lines(outcome)                       # ["✅ every replica holds the same bits", ...]
    explore_link(step.explore, outcome.facts)  # the page file, its label, the page's URL parameters

The page is thin wiring; what it decides (which lesson and step a URL opens, what a check line
says, where a deep link goes and with which parameters, what a missing extra needs) lives here,
where a unit test reaches it without a browser. ``PAGE`` is how the app lists the page: the
entry point ``dplab.app_pages`` names it (the app, in viz/, does not import the lessons).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dplab.lessons.runner import StepOutcome
from dplab.lessons.step import Explore, Facts, Predict, Verdict
from dplab.viz.added_pages import AddedPage
from dplab.viz.deep_links import PAGE_FILES, PAGE_TITLES, adopt, unread

__all__ = ["PAGE", "PASS", "FAIL", "PLACEHOLDER", "score_line", "position", "check_lines",
           "answer_kind", "Link", "explore_link", "needs_line", "lessons_link_params", "is_command",
           "took"]



def preload_lessons() -> None:
    """Import every module of ``dplab.lessons`` but the page script and the exercises' stubs and
    solutions (learners' files): ``dplab app``'s server does it once, before sessions' threads
    could import them at the same time."""
    import importlib
    import pkgutil

    import dplab.lessons

    skip = ("dplab.lessons.page", ".stubs", ".solutions")
    for found in pkgutil.walk_packages(dplab.lessons.__path__, "dplab.lessons.",
                                       onerror=lambda name: None):
        if not any(found.name == s or (s.startswith(".") and s in found.name) for s in skip):
            importlib.import_module(found.name)


PAGE = AddedPage(
    "lessons", Path(__file__).resolve().with_name("page.py"), "Lessons", ":material/school:",
    "step through the ideas of data parallelism on the real engine: predict each result, then see "
    "it measured, with the checks that prove it and a link to the page that explores it further.",
    preload_lessons)
PASS, FAIL = "✅", "❌"
# How to type a number, without a number in it: any example could be some question's answer (2.1's
# was "1,572,864 or 1.5 MiB", shown in the box before the learner answered).
PLACEHOLDER = "a number: commas, fractions, exponents, KiB and MiB all work"


def score_line(verdicts: Iterable[Verdict | None]) -> str:
    """``Predictions in this lesson: 2 of 3 right.`` (a question shown without an answer is
    asked)."""
    verdicts = list(verdicts)
    right = sum(v is not None and v.correct for v in verdicts)
    return f"Predictions in this lesson: {right} of {len(verdicts)} right."


def _int(raw: object) -> int | None:
    try:
        return int(str(raw))
    except ValueError:
        return None


def position(query: Mapping[str, str], numbers: list[int],
             length_of: Callable[[int], int]) -> tuple[int, int]:
    """The (lesson number, step index from 0) that ``?lesson=N&step=K`` opens (K counts from 1, as
    the page shows it). No lesson or an unknown one: the first lesson; a step past the end: its
    last."""
    if not numbers:
        raise ValueError("no lessons to open")
    number = _int(query.get("lesson", ""))
    number = number if number in numbers else numbers[0]
    step = _int(query.get("step", "")) or 1
    return number, min(max(step, 1), length_of(number)) - 1


def lessons_link_params(number: int, index: int) -> dict[str, str]:
    """The URL parameters that open step ``index`` (from 0) of lesson ``number`` on the Lessons
    page."""
    return {"lesson": str(number), "step": str(index + 1)}


def check_lines(outcome: StepOutcome) -> list[str]:
    """One line per claim, marked with whether it held on this run."""
    return [f"{PASS if c.holds else FAIL} {c.claim}" for c in outcome.checks]


def answer_kind(predict: Predict) -> str:
    """``"choices"`` (a radio of the choices) or ``"number"`` (free text: 1,572,864 or 1.5 MiB both
    parse)."""
    return "choices" if predict.choices else "number"


@dataclass(frozen=True)
class Link:
    """A deep link from a step to the page that explores it."""

    page: str                                  # the page's name, e.g. "collectives"
    file: str                                  # as st.page_link takes it: "pages/collectives.py"
    label: str                                 # "Explore on the Collectives page"
    params: dict[str, str]                     # in the page's own names (coll_p, world_size, ...)
    unread: tuple[str, ...] = ()               # names the page would ignore: a bug in the lesson


def explore_link(explore: Explore, facts: Facts) -> Link:
    """Where ``explore`` goes and with what: the lesson's short names become the page's own, so the
    page's widgets take them as they take their own URL (``dplab.viz.deep_links``)."""
    if explore.page not in PAGE_FILES:
        raise ValueError(f"no app page {explore.page!r}: one of {', '.join(PAGE_FILES)}")
    query = explore.query(facts)
    params = dict(query)
    adopt(params, explore.page)
    title = PAGE_TITLES[explore.page]
    return Link(explore.page, PAGE_FILES[explore.page], f"Explore this on the {title} page", params,
                tuple(unread(explore.page, query)))


def is_command(try_this: str) -> bool:
    """A "try this" line that is a shell command (shown as one, to copy) rather than a sentence."""
    first = try_this.split(maxsplit=1)[0] if try_this.strip() else ""
    return first in (
        "dplab",
        "python",
        "python3",
        "pytest",
        "mpiexec",
        "torchrun",
        "pip",
        "streamlit",
    )


def took(seconds: float) -> str:
    """How long a step ran, readable at every scale: ``1.23 s``, ``45 ms``, ``0.3 ms``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2g} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def needs_line(number: int, missing: list[str]) -> str:
    """What to install for a lesson whose extras are missing, as one line."""
    extras = ",".join(missing)
    return (f"Lesson {number} needs the {' and '.join(missing)} "
            f"extra{'s' if len(missing) > 1 else ''}, not installed here: `pip install -e "
            f"'.[{extras}]'` (from a checkout), then reload this page.")
