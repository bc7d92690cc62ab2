"""Lessons: step through a lesson on the real engine, predicting each result before it is shown.

    dplab app                                  # then Lessons; or open a step directly:
    http://127.0.0.1:8501/lessons?lesson=1&step=2

Predict first, as in the terminal: a step with a question shows the question, an answer box, Check,
Show me and tiered hints, and nothing else (no code, result, figure or "try this": any may hold the
answer) until it is answered or shown; a question filled from the step's inputs is asked before
the step even runs. The same steps as ``dplab lesson N``: each runs through
``dplab.lessons.runner.run_step`` on this session's ``Lab`` (one per session, a new one when the
lesson changes; its ranks are closed after each run, see ``_outcome``) and its outcome is kept per
step, so Back and Next do not run it again. A step runs after the ones before it, as in CI (a step
may use what an earlier one left in ``lab.scratch``). What the page decides lives in
``dplab.lessons.page_view``; this file draws it. The app (viz/app.py) finds this file by the
entry point ``dplab.app_pages``, so it runs as one of the app's pages without viz importing it.
"""

from __future__ import annotations

from typing import Any

import streamlit as st
from streamlit.errors import StreamlitPageNotFoundError

from dplab.lessons import lesson, numbers
from dplab.lessons.page_view import (
    PLACEHOLDER,
    answer_kind,
    check_lines,
    explore_link,
    is_command,
    lessons_link_params,
    needs_line,
    position,
    score_line,
    took,
)
from dplab.lessons.runner import Lab, StepOutcome, missing_needs, run_step
from dplab.lessons.step import Lesson, Step, fill
from dplab.viz.budget import BUDGET

# widget; step index; where the learner was
PICK, STEP, AT = "lesson_pick", "lesson_step", "lesson_at"
WRITTEN = "_lesson_in_url"  # the (lesson, step) this page last put in the URL
OUTCOMES, LAB, REVEALED, VERDICTS = (
    "lesson_outcomes",
    "lesson_lab",
    "lesson_revealed",
    "lesson_verdicts",
)
# the replies checked; how many hints each step has shown; the steps whose Check found no reply
REPLIES, HINTS, EMPTY = "lesson_replies", "lesson_hints", "lesson_empty"
state = st.session_state


def _title(number: int) -> str:
    try:
        les = lesson(number)
    except Exception as e:  # noqa: BLE001 - a lesson being written must not take the page down
        return f"{number} · (does not load: {type(e).__name__})"
    return f"{number} · {les.title} ({len(les.steps)} steps)"


def _start(nums: list[int]) -> None:
    """The lesson and step from ``?lesson=N&step=K`` unless this page wrote them there on its last
    run (a new visit or a link, even from this page); a visit without them:
    where the learner was."""
    query = st.query_params.to_dict()
    url = (query.get("lesson"), query.get("step"))
    if PICK in state and (url[0] is None or url == state.get(WRITTEN)):
        return
    if url[0] is None and AT in state:
        query = lessons_link_params(*state[AT])
    number, k = position(query, nums, lambda n: len(lesson(n).steps))
    state[PICK], state[STEP] = number, k


def _close_lab() -> None:
    held = state.pop(LAB, None)
    if held is not None:
        held[1].close()
    state[OUTCOMES] = {}


def _picked() -> None:
    """Another lesson: its first step, on fresh ranks (the last lesson's worlds are closed now)."""
    state[STEP] = 0
    _close_lab()


def _move(k: int) -> None:
    state[STEP] = k


def _reveal(key: tuple[int, int]) -> None:
    state.setdefault(REVEALED, set()).add(key)


def _check(key: tuple[int, int], answer_key: str) -> None:
    """Check: keep the reply and reveal the step (judged where the step's facts are, in ``_step``);
    nothing typed: say so, reveal nothing."""
    reply = state.get(answer_key)
    if reply is None or not str(reply).strip():
        state.setdefault(EMPTY, set()).add(key)
        return
    state.setdefault(EMPTY, set()).discard(key)
    state.setdefault(REPLIES, {})[key] = str(reply)
    state.setdefault(VERDICTS, {}).pop(key, None)
    _reveal(key)


def _more_hint(key: tuple[int, int], tiers: int) -> None:
    hints = state.setdefault(HINTS, {})
    hints[key] = min(hints.get(key, 0) + 1, tiers)


def _outcome(les: Lesson, k: int) -> StepOutcome | Exception:
    """Step ``k``'s outcome, running it (and any step before it not yet run) on this session's Lab.
    Its worlds go through the server's rank budget, as every other page's runs do (a lease: a
    step may hold two worlds at once)."""
    held = state.get(LAB)
    if held is None or held[0] != les.number:
        _close_lab()
        state[LAB] = (les.number, Lab(open_world=BUDGET.lease().world))
    lab, done = state[LAB][1], state.setdefault(OUTCOMES, {})
    try:
        for i in range(k + 1):
            if i not in done:
                with st.spinner(f"running step {i + 1} of lesson {les.number} on the real engine "
                                "..."):
                    try:
                        done[i] = _run(les.steps[i], lab)
                    except Exception as e:  # noqa: BLE001 - shown on the page, in one box
                        done[i] = e
    finally:
        lab.close()
    return done[k]


def _run(step: Step, lab: Lab) -> StepOutcome:
    """One step on the lab, whose worlds are closed after it: ranks are forked from the app's
    server and hold copies of its sockets (a browser connection the server closed stayed open in
    them, and the next request on it hung until they exited), and held ranks are the budget's.
    A world of 4 starts in ~0.3 s; the Lab and its scratch stay for the next step."""
    try:
        return run_step(step, lab)
    finally:
        lab.close()


def _question(step: Step, question: str, key: tuple[int, int]) -> None:
    """The question and its controls: an answer box (its placeholder says how to type a number,
    never a number), Check, Show me, and a hint button that reveals the next tier (never an
    answer)."""
    predict = step.predict
    answer_key = f"lesson_answer_{key[0]}_{key[1]}"
    st.markdown(f"**Predict first.** {question}")
    if answer_kind(predict) == "choices":
        st.radio("your answer", predict.choices, index=None, key=answer_key, horizontal=True)
    else:
        st.text_input(
            "your answer" + (f" ({predict.unit})" if predict.unit else ""),
            key=answer_key,
            placeholder=PLACEHOLDER,
            width=360,
        )
    tiers = step.all_hints()
    shown = state.get(HINTS, {}).get(key, 0)
    c = st.columns([1, 1, 1, 5])
    c[0].button(
        "Check",
        key=f"lesson_check_{key[0]}_{key[1]}",
        on_click=_check,
        args=(key, answer_key),
        type="primary",
    )
    c[1].button("Show me", key=f"lesson_show_{key[0]}_{key[1]}", on_click=_reveal, args=(key,))
    if shown < len(tiers):
        c[2].button(
            f"Hint {shown + 1} of {len(tiers)}" if len(tiers) > 1 else "Hint",
            key=f"lesson_hint_{key[0]}_{key[1]}",
            on_click=_more_hint,
            args=(key, len(tiers)),
        )
    for i in range(shown):
        st.info(f"**Hint{f' {i + 1}' if len(tiers) > 1 else ''}.** {tiers[i]}")
    if key in state.get(EMPTY, set()):
        st.info("Type or pick an answer first, or press Show me.")


def _verdict(out: StepOutcome, key: tuple[int, int]) -> None:
    """The answered question and its verdict, judged on this run's facts."""
    st.markdown(f"**Predict first.** {out.question()}")
    reply = state.get(REPLIES, {}).get(key)
    verdicts = state.setdefault(VERDICTS, {})  # None: shown without an answer (asked, not right)
    if key not in verdicts:
        verdicts[key] = None if reply is None else out.step.predict.judge(out.facts, reply)
    verdict = verdicts[key]
    if verdict is None:
        st.caption("Shown without an answer: it is "
                   f"{out.step.predict.judge(out.facts, '').expected}.")
    elif verdict.correct:
        st.success(f"Right: {verdict.expected}, measured on this run.")
    else:
        st.warning(verdict.message[:1].upper() + verdict.message[1:] + ".")
    st.caption(score_line(v for (number, _), v in verdicts.items() if number == key[0]))


def _result(out: StepOutcome, key: tuple[int, int]) -> None:
    st.markdown(out.text)
    if out.printed.strip():
        with st.expander("What the run printed"):
            st.code(out.printed, language="text")
    if out.figure is not None:
        st.plotly_chart(out.figure, key=f"lesson_fig_{key[0]}_{key[1]}")
    st.markdown(f"**What this step proves** (checked on this run: {took(out.seconds)} on the real "
                "engine)")
    for line in check_lines(out):
        st.markdown(line)


def _link(out: StepOutcome) -> None:
    link = explore_link(out.step.explore, out.facts)
    try:
        st.page_link(
            link.file, label=link.label, query_params=link.params, icon=":material/open_in_new:"
        )
    except StreamlitPageNotFoundError:
        st.caption(
            f"The {link.page} page is not in this app yet: it will explore this step further."
        )


def _step(les: Lesson, k: int) -> None:
    step, key = les.steps[k], (les.number, k)
    st.subheader(f"{k + 1}. {step.title}")
    if step.predict is not None and key not in state.get(REVEALED, set()):
        if step.asks_before_run():  # its givens are known: ask before running anything
            _question(step, fill(step.predict.question, step.inputs), key)
        else:  # the question needs the run's numbers: run it, show only the question
            out = _outcome(les, k)
            if isinstance(out, Exception):
                st.error(f"This step did not run: {type(out).__name__}: {out}")
                return
            _question(step, out.question() or "", key)
        st.caption("The result, the figure, the code and what the step proves show once you answer "
                   "(or press Show me).")
        return
    out = _outcome(les, k)
    if isinstance(out, Exception):
        st.error(f"This step did not run: {type(out).__name__}: {out}")
        return
    _reveal(key)
    if step.predict is not None:
        _verdict(out, key)
    _result(out, key)
    st.markdown("**The code**" + ("" if step.show else " this step runs"))
    st.code(step.code(), language="python")
    hints = step.all_hints()
    if hints:
        with st.expander("Hints" if len(hints) > 1 else "Hint"):
            st.markdown(
                "\n\n".join(f"{i + 1}. {h}" if len(hints) > 1 else h for i, h in enumerate(hints))
            )
    if step.try_this and is_command(step.try_this):
        st.markdown("**Try this** in a terminal:")
        st.code(step.try_this, language="bash")
    elif step.try_this:
        st.markdown(f"**Try this:** {step.try_this}")
    if step.exercise:
        st.caption(f"Exercise `{step.exercise}`: `dplab lesson init DIR` copies the stub, "
                   f"`dplab lesson check {les.number} DIR` checks your code; "
                   f"`dplab lesson watch {les.number} DIR` re-checks it on every save.")
    if step.explore is not None:
        _link(out)


def _nav(les: Lesson, k: int, where: Any) -> None:
    n = len(les.steps)
    c = where.columns([1, 1, 8])
    c[0].button("◀ Back", key="lesson_back", on_click=_move, args=(k - 1,), disabled=k == 0)
    c[1].button("Next ▶", key="lesson_next", on_click=_move, args=(k + 1,), disabled=k == n - 1)


st.title("Lessons")
nums = numbers()
if not nums:
    st.info("No lessons yet.")
    st.stop()
_start(nums)
st.selectbox("lesson", nums, key=PICK, format_func=_title, on_change=_picked)
try:
    les = lesson(state[PICK])
except Exception as e:  # noqa: BLE001 - a lesson being written must not take the page down
    st.error(f"Lesson {state[PICK]} does not load: {type(e).__name__}: {e}")
    st.stop()
st.caption(les.summary)
missing = missing_needs(les)
if missing:
    st.warning(needs_line(les.number, missing))
    st.markdown("\n".join(f"{i + 1}. {s.title}" for i, s in enumerate(les.steps)))
    st.stop()
k = min(max(state.get(STEP, 0), 0), len(les.steps) - 1)
state[STEP], state[AT] = k, (les.number, k)
st.query_params.update(lessons_link_params(les.number, k))
state[WRITTEN] = (str(les.number), str(k + 1))
st.progress((k + 1) / len(les.steps), text=f"step {k + 1} of {len(les.steps)}")
_nav(les, k, st)
_step(les, k)
if k < len(les.steps) - 1:  # the learner is at the bottom when done reading
    st.button(
        f"Next: {les.steps[k + 1].title} ▶", key="lesson_next_end", on_click=_move, args=(k + 1,)
    )
