"""A lesson as a Jupyter notebook, generated from its steps: the same ``Lesson`` and ``Step`` data
the terminal and the app render, so there is no second copy of the text to drift.

    dplab lesson notebooks DIR        # DIR/lesson01_replicas.ipynb ... one per lesson

    from dplab.lessons.notebook import NotebookLesson   # what the generated cells call
    les = NotebookLesson(2)
    les.ask(1)          # the step's question (run first, unseen, when it needs the run's numbers)
    answer = "1.5 MiB"  # your prediction: an input cell
    les.step(1, answer) # the run: your answer judged, the text, the figure, the code, the checks

A notebook holds only the lesson's structure: a title cell per step, and cells that call
``NotebookLesson``. The text, its numbers, the question, the checks and the plotly figure (the
app's own builder) come from running the step in the kernel, as in ``dplab lesson N``. A claim that
does not hold on the run raises ``LessonCheckFailed``, so a notebook that no longer teaches the
truth stops there (CI executes every notebook, ``tests/test_lesson_notebooks.py``). The worlds of
ranks are kept for the kernel's life (one ``Lab``, closed at exit), as the terminal keeps them for a
lesson.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

from dplab.lessons import lesson, lessons
from dplab.lessons.page_view import PLACEHOLDER, check_lines, explore_link, is_command, took
from dplab.lessons.runner import Lab, StepOutcome, missing_needs, run_step
from dplab.lessons.step import Lesson, Step, Verdict, fill
from dplab.reference.errors import ConfigError

__all__ = ["NotebookLesson", "notebook", "notebook_name", "write_notebooks", "EXTRAS"]

EXTRAS = "mpi,torch,viz,notebook"  # what the first cell installs: every lesson's needs, Jupyter's

_lab: Lab | None = None


def _shared_lab() -> Lab:
    """The kernel's one Lab: its worlds live until the kernel exits (starting ranks is slow)."""
    global _lab
    if _lab is None:
        _lab = Lab()
        atexit.register(_lab.close)
    return _lab


def _show(*things: Any) -> None:
    """Markdown strings and plotly figures, rendered in a notebook; printed anywhere else."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    for thing in things:
        if get_ipython is not None and get_ipython() is not None:
            display(Markdown(thing) if isinstance(thing, str) else thing)
        else:
            print(thing)


class NotebookLesson:
    """Lesson ``number``'s steps, run in order in a notebook's kernel (steps numbered from 1).

    Args:
        number: the lesson, as ``dplab lesson N`` takes it.

    Raises:
        ConfigError: no such lesson, or an extra it needs is not installed (the line says what to
            install).
    """

    def __init__(self, number: int) -> None:
        self.lesson: Lesson = lesson(number)
        missing = missing_needs(self.lesson)
        if missing:
            raise ConfigError(f"lesson {number} needs the {' and '.join(missing)} extra: "
                              f"pip install 'dplab[{','.join(missing)}]', then restart the kernel")
        self.lab = _shared_lab()
        self.lab.scratch.clear()  # what one step leaves for the next belongs to this lesson
        self.outcomes: dict[int, StepOutcome] = {}
        self.verdicts: dict[int, Verdict | None] = {}

    def _step(self, k: int) -> Step:
        if not 1 <= k <= len(self.lesson.steps):
            raise ConfigError(f"lesson {self.lesson.number} has steps 1..{len(self.lesson.steps)}, "
                              f"not {k}")
        return self.lesson.steps[k - 1]

    def outcome(self, k: int) -> StepOutcome:
        """Step ``k`` run once (kept: asking and showing use the same run)."""
        step = self._step(k)
        if k not in self.outcomes:
            self.outcomes[k] = run_step(step, self.lab)
        return self.outcomes[k]

    def ask(self, k: int) -> None:
        """Show step ``k``'s question; a question that needs the run's numbers runs the step first,
        showing nothing of it."""
        step = self._step(k)
        if step.predict is None:
            raise ConfigError(f"step {k} of lesson {self.lesson.number} asks no question")
        question = (fill(step.predict.question, step.inputs) if step.asks_before_run()
                    else self.outcome(k).question())
        unit = f" (in {step.predict.unit})" if step.predict.unit else ""
        choices = f" One of: {', '.join(step.predict.choices)}." if step.predict.choices else ""
        _show(f"**Predict first.** {question}{unit}{choices}\n\nType your answer in the next cell, "
              "then run the cell after it.")

    def step(self, k: int, answer: str | None = None) -> None:
        """Run step ``k`` (once) and show it: ``answer`` judged against the run, the text filled
        from it, what it printed, the figure, the checks, the code, the hints.

        Raises:
            LessonCheckFailed: a claim of the step did not hold on this run.
        """
        step, out = self._step(k), self.outcome(k)
        if step.predict is not None:
            self.verdicts[k] = verdict = step.predict.judge(out.facts, answer) if answer else None
            if verdict is None:
                said = f"No answer given: it is {step.predict.judge(out.facts, '').expected}."
            else:
                said = ("Right" if verdict.correct else "Not right") + f": {verdict.message}."
            _show(f"**Your prediction.** {said}")
        _show(out.text)
        if out.printed.strip():
            _show(f"What the run printed:\n\n```text\n{out.printed.rstrip()}\n```")
        if out.figure is not None:
            _show(out.figure)
        _show(f"**What this step proves** (checked on this run: {took(out.seconds)} on the real "
              "engine)\n\n" + "\n".join(f"- {line}" for line in check_lines(out)))
        _show(self._more(step, out))
        out.raise_if_failed()

    def _more(self, step: Step, out: StepOutcome) -> str:
        title = "**The code**" + ("" if step.show else " this step runs")
        parts = [f"{title}\n\n```python\n{step.code()}\n```"]
        hints = step.all_hints()
        if hints:
            listed = "\n\n".join(f"{i + 1}. {h}" for i, h in enumerate(hints))
            plural = "s" if len(hints) > 1 else ""
            parts.append(f"<details><summary>Hint{plural}</summary>\n\n{listed}\n\n</details>")
        if step.try_this:
            parts.append("**Try this** in a terminal (or a cell, after `!`):\n\n"
                         f"```bash\n{step.try_this}\n```" if is_command(step.try_this)
                         else f"**Try this:** {step.try_this}")
        if step.exercise:
            n = self.lesson.number
            parts.append(f"**Exercise** `{step.exercise}`: `!dplab lesson init work` copies the "
                         f"stub into work/, `!dplab lesson check {n} work` checks your code in the "
                         "lesson's words.")
        if step.explore is not None:
            link = explore_link(step.explore, out.facts)
            query = "&".join(f"{k}={v}" for k, v in link.params.items())
            parts.append(f"**Explore** it in the app (`dplab app`): the {link.page} page, "
                         f"`/{link.page}{'?' + query if query else ''}`.")
        return "\n\n".join(parts)


def notebook_name(les: Lesson) -> str:
    """``lesson02_allreduce.ipynb``: sorted in teaching order."""
    return f"lesson{les.number:02d}_{les.slug}.ipynb"


_SETUP = '''# Run this cell first. It installs dplab where it is not installed yet (Colab, a fresh
# Jupyter), from its repository: set REPOSITORY to the git URL (or folder) dplab came from.
REPOSITORY = {repo!r}

import importlib.util
import shutil
import subprocess
import sys

if importlib.util.find_spec("dplab") is None:
    if not REPOSITORY:
        raise SystemExit("dplab is not installed here: set REPOSITORY above to its git URL, "
                         "e.g. 'https://github.com/<owner>/dplab', and run this cell again")
    remote = REPOSITORY.startswith(("http", "git+", "ssh:"))
    spec = ("dplab[{extras}] @ git+" + REPOSITORY.removeprefix("git+") if remote
            else REPOSITORY + "[{extras}]")  # a folder: a checkout of the repository
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], check=True)

# The steps run on the local backend (NumPy processes). With a GPU (Colab: Runtime > Change
# runtime type > T4 GPU; its free one holds four ranks), pick the cuda backend to run the same
# training on it, e.g. in a cell:  !dplab train --backend cuda --world-size 4
GPU = shutil.which("nvidia-smi") is not None
print("A GPU is here: --backend cuda runs four ranks on it." if GPU
      else "No GPU here: the local backend runs every step.")'''


def notebook(les: Lesson, repo: str = "") -> Any:
    """The notebook of ``les``: a title, the setup cell, then per step a title and the cells that
    run it (a question's answer is an input cell, judged by the cell below it).

    Args:
        les: the lesson.
        repo: what the setup cell installs dplab from where it is missing (a git URL or a folder).

    Returns:
        An ``nbformat`` v4 notebook (``nbformat.write`` saves it).
    """
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    needs = f" It needs the {', '.join(les.needs)} extra{'s' if len(les.needs) > 1 else ''}." \
        if les.needs else ""
    cells = [
        new_markdown_cell(
            f"# Lesson {les.number}: {les.title}\n\n{les.summary}\n\n"
            "Each step runs dplab's real engine at a small size and shows what happened, with the "
            f"checks that prove its claim (the same steps as `dplab lesson {les.number}` and the "
            "app's Lessons page). Where a step asks you to predict first, type your answer in the "
            "cell under the question, then run the step's cell: it judges your answer against the "
            f"run.{needs}"),
        new_code_cell(_SETUP.format(repo=repo, extras=EXTRAS)),
        new_code_cell("from dplab.lessons.notebook import NotebookLesson\n\n"
                      f"les = NotebookLesson({les.number})"),
    ]
    for k, step in enumerate(les.steps, 1):
        cells.append(new_markdown_cell(f"## {les.number}.{k} {step.title}"))
        if step.predict is not None:
            cells.append(new_code_cell(f"les.ask({k})"))
            how = (f"one of: {', '.join(step.predict.choices)}" if step.predict.choices
                   else PLACEHOLDER)  # an example number could be some question's answer
            cells.append(new_code_cell(f'answer = ""  # your prediction: {how}'))
            cells.append(new_code_cell(f"les.step({k}, answer)"))
        else:
            cells.append(new_code_cell(f"les.step({k})"))
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}})
    nbformat.validate(nb)
    return nb


def write_notebooks(out: str | os.PathLike[str], repo: str = "") -> list[Path]:
    """Write every lesson's notebook into the folder ``out`` (made if missing).

    Returns:
        The files written, in teaching order.

    Raises:
        ConfigError: ``out`` is not a folder that can be written, or nbformat is not installed.
    """
    try:
        import nbformat
    except ImportError:
        raise ConfigError("writing notebooks needs nbformat: pip install 'dplab[notebook]'") \
            from None
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make the folder {str(folder)!r} ({e.strerror}): give a folder "
                          "you can write") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write into {str(folder)!r}: give a folder you can write")
    written = []
    for les in lessons():
        path = folder / notebook_name(les)
        try:
            nbformat.write(notebook(les, repo), str(path))
        except OSError as e:
            raise ConfigError(f"cannot write {str(path)!r} ({e.strerror}): give a folder you can "
                              "write") from None
        written.append(path)
    return written
