"""The Lessons page under ``AppTest``, its pure helpers, and deep links into the other pages.

    pytest -q tests/test_viz_lessons_page.py

Lesson 1 is the one every test opens (it exists from the start; its first step trains four ranks
for ~1 s); the page must work for any lesson, so nothing here depends on how many there are.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra is not installed: pip install "
                                             "'dplab[viz]'")
pytest.importorskip("plotly", reason="the viz extra is not installed: pip install 'dplab[viz]'")
from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.lessons import lesson, numbers, page_view  # noqa: E402
from dplab.lessons import runner as lesson_runner  # noqa: E402
from dplab.lessons.runner import CheckResult, StepOutcome  # noqa: E402
from dplab.lessons.step import Check, Explore, Predict, Step  # noqa: E402
from dplab.viz import deep_links  # noqa: E402
from dplab.viz.serve import app_path  # noqa: E402

L1 = lesson(1)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """st.cache_data is shared by every AppTest in this process: each test starts from none."""
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _app(page: str = str(page_view.PAGE.file), **params: str) -> AppTest:
    at = AppTest.from_file(str(app_path()), default_timeout=60)
    for name, value in params.items():
        at.query_params[name] = value
    at.run()
    at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


def _counter(at: AppTest) -> str:
    return at.get("progress")[0].proto.text


def _checks(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if m.value[:1] in (page_view.PASS, page_view.FAIL)]


def _show(at: AppTest) -> None:
    """Press Show me when the step asks first (a question its inputs fill is asked before it
    runs)."""
    for button in at.button:
        if button.key and button.key.startswith("lesson_show_"):
            button.click().run()
            return


def _close(at: AppTest) -> None:
    held = at.session_state["lesson_lab"] if "lesson_lab" in at.session_state else None
    if held is not None:
        held[1].close()


# --- the page -------------------------------------------------------------------------------------

def test_lesson_one_opens_next_back_move_the_counter_and_it_links_to_training():
    at = _app()
    try:
        assert at.title[0].value == "Lessons"
        assert at.selectbox(key="lesson_pick").value == 1
        assert _counter(at) == f"step 1 of {len(L1.steps)}"
        assert at.subheader[0].value == f"1. {L1.steps[0].title}"
        assert (
            at.button(key="lesson_back").proto.disabled
            and not at.button(key="lesson_next").proto.disabled
        )
        # predict first: nothing but the question yet
        assert not at.code and not at.get("page_link")
        at.button(key="lesson_show_1_0").click().run()
        assert at.code[0].value == L1.steps[0].code()
        # the deep link: the lesson writes world_sizes=4 (its words);
        # the Training page keeps world_size
        link, explore = at.get("page_link")[-1].proto, L1.steps[0].explore
        assert explore.page == "training" and link.page_script_hash  # a page the navigation has
        facts = at.session_state["lesson_outcomes"][0].facts
        assert explore.query(facts) == {"world_sizes": "4", "steps": "50"}
        assert link.label == "Explore this on the Training page"
        assert link.query_string == "steps=50&world_size=4"
        at.button(key="lesson_next").click().run()
        assert _counter(at) == f"step 2 of {len(L1.steps)}" and at.query_params["step"] == "2"
        assert at.subheader[0].value == f"2. {L1.steps[1].title}"
        at.button(key="lesson_back").click().run()
        assert _counter(at) == f"step 1 of {len(L1.steps)}" and at.query_params["step"] == "1"
        for k in range(1, len(L1.steps)):  # to the end: every step renders, Next stops there
            at.button(key="lesson_next").click().run()
            assert not at.exception and not at.error, (k, at.exception, at.error)
            assert _counter(at) == f"step {k + 1} of {len(L1.steps)}"
        assert at.button(key="lesson_next").proto.disabled
        assert at.get("progress")[0].proto.value == 100
    finally:
        _close(at)


def test_answers_right_and_wrong_show_their_verdicts_and_reveal_the_result():
    at = _app()
    try:
        # step 1 asks a choice: nothing of the result, the code or the hints shows before the answer
        assert _checks(at) == [] and not at.get("plotly_chart") and not at.code and not at.expander
        at.radio(key="lesson_answer_1_0").set_value("different").run()
        at.button(key="lesson_check_1_0").click().run()
        facts = at.session_state["lesson_outcomes"][0].facts  # its question was asked before it ran
        said = L1.steps[0].predict.judge(facts, "different").message
        assert said.startswith("not quite: it is identical")
        assert [w.value for w in at.warning] == [said[:1].upper() + said[1:] + "."]
        # revealed by the answer
        assert _checks(at) == [f"✅ {c.claim}" for c in L1.steps[0].checks]
        fig = json.loads(at.get("plotly_chart")[0].proto.spec)
        assert len(fig["data"]) > 0  # the live timeline of the run
        assert "identical to the bit (checked)" in " ".join(m.value for m in at.markdown)
        assert at.code[0].value == L1.steps[0].code()
        # answered: no second guess
        assert not [r for r in at.radio if r.key == "lesson_answer_1_0"]
        assert "Predictions in this lesson: 0 of 1 right." in [c.value for c in at.caption]
        # step 2 asks a number: 10 samples on 4 ranks, rank 0 gets 3
        at.button(key="lesson_next").click().run()
        # no answer yet: asked for one, nothing revealed
        at.button(key="lesson_check_1_1").click().run()
        assert [i.value for i in at.info] == ["Type or pick an answer first, or press Show me."]
        assert _checks(at) == []
        at.text_input(key="lesson_answer_1_1").input("3").run()
        at.button(key="lesson_check_1_1").click().run()
        assert [s.value for s in at.success] == [
            "Right: 3, measured on this run."
        ] and not at.warning
        assert len(_checks(at)) == len(L1.steps[1].checks)
        assert "Predictions in this lesson: 1 of 2 right." in [c.value for c in at.caption]
    finally:
        _close(at)


RUNS: list[int] = []


def _bytes_run(lab):
    RUNS.append(1)
    return {"p": 4, "n_bytes": 1 << 20, "sent": 1_572_864, "secret": "SECRET-RESULT"}


def test_a_question_from_inputs_is_asked_before_the_run_with_tiered_hints_and_no_answer_in_sight(
    monkeypatch,
):
    import dplab.lessons.l01_replicas as l01
    from dplab.reference.algorithms import ring

    step = Step(
        "Bytes",
        "the result: {secret}",
        _bytes_run,
        checks=(Check("sent {sent:,}", lambda f: True),),
        predict=Predict(
            "At p={p}, bytes for {n_bytes:size}?",
            "sent",
            unit="bytes",
            misconceptions=((3 << 20, "that is the naive root's share"),),
        ),
        hint="one chunk a round",
        hints=("2(p-1) rounds",),
        try_this="dplab train --world-size 4",
        inputs={"p": 4, "n_bytes": 1 << 20},
        show=(ring.allreduce,),
    )
    monkeypatch.setattr(l01, "LESSON", dataclasses.replace(L1, steps=(step, *L1.steps[1:])))
    RUNS.clear()
    at = _app()
    try:
        page = " ".join(m.value for m in at.markdown)
        assert "At p=4, bytes for 1 MiB?" in page and "SECRET" not in page and not at.code
        assert RUNS == [] and "lesson_lab" not in at.session_state      # asked before anything ran
        box = at.text_input(key="lesson_answer_1_0")
        assert box.placeholder == page_view.PLACEHOLDER and not any(
            c.isdigit() for c in box.placeholder
        )
        assert at.button(key="lesson_hint_1_0").label == "Hint 1 of 2"
        at.button(key="lesson_hint_1_0").click().run()
        assert [i.value for i in at.info] == ["**Hint 1.** one chunk a round"]
        at.button(key="lesson_hint_1_0").click().run()
        assert len(at.info) == 2 and not [b for b in at.button if b.key == "lesson_hint_1_0"]
        # a hint is not an answer
        assert RUNS == [] and not at.warning and not at.success
        at.text_input(key="lesson_answer_1_0").input("3 MiB").run()
        at.button(key="lesson_check_1_0").click().run()
        assert RUNS == [1]
        (warning,) = [w.value for w in at.warning]
        assert "that is the naive root's share" in warning and "1,572,864" in warning
        assert "the result: SECRET-RESULT" in " ".join(m.value for m in at.markdown)
        assert at.code[0].value == step.code() and "def allreduce" in at.code[0].value
    finally:
        _close(at)


def test_query_params_open_a_step_and_show_me_reveals_it():
    at = _app(lesson="1", step="2")
    try:
        assert _counter(at) == f"step 2 of {len(L1.steps)}" and at.subheader[0].value.startswith(
            "2. "
        )
        assert _checks(at) == [] and at.button(key="lesson_show_1_1")
        at.button(key="lesson_show_1_1").click().run()
        # step 2 ran after step 1, on the same Lab, as in CI
        assert sorted(at.session_state["lesson_outcomes"]) == [0, 1]
        assert _checks(at) == [f"✅ {c.claim}" for c in L1.steps[1].checks]
        assert "Shard sizes: [3, 3, 2, 2]" in " ".join(m.value for m in at.markdown)
        assert not [b for b in at.button if b.key == "lesson_show_1_1"]  # shown: the button is gone
        assert "Predictions in this lesson: 0 of 1 right." in [c.value for c in at.caption]  # asked
        at.query_params["step"] = "4"  # a link to another step, followed in the same session
        at.run()
        assert _counter(at) == f"step 4 of {len(L1.steps)}" and at.subheader[0].value.startswith(
            "4. "
        )
        at.button(key="lesson_back").click().run()  # the page's own URL does not pull it back
        assert _counter(at) == f"step 3 of {len(L1.steps)}" and at.query_params["step"] == "3"
    finally:
        _close(at)


def test_no_rank_outlives_the_run_that_needed_it():
    """Ranks forked from the app's server hold copies of its sockets: alive between runs, they kept
    connections the server had closed open, and the browser's next request on one (the plotly
    chart's script after Check) hung for ever. The Lab (and its scratch) stays; its worlds do
    not."""
    at = _app()
    try:
        at.button(key="lesson_show_1_0").click().run()
        lab = at.session_state["lesson_lab"][1]
        assert 0 in at.session_state["lesson_outcomes"]  # step 1 ran on a world of 4 ranks ...
        assert lab._worlds == {}  # ... closed before the page was sent
        at.button(key="lesson_next").click().run()
        at.button(key="lesson_show_1_1").click().run()
        assert at.session_state["lesson_lab"][1] is lab and lab._worlds == {}
    finally:
        _close(at)


def test_picking_another_lesson_starts_it_on_a_new_lab():
    other = next((n for n in numbers() if n != 1), None)
    if other is None:
        pytest.skip("only lesson 1 is registered")
    at = _app()
    try:
        at.button(key="lesson_next").click().run()
        _show(at)
        lab = at.session_state["lesson_lab"][1]
        lab.scratch["left"] = "by lesson 1"
        at.selectbox(key="lesson_pick").set_value(other).run()
        assert not at.exception
        _show(at)
        fresh = at.session_state["lesson_lab"][1]
        assert fresh is not lab and "left" not in fresh.scratch
        assert at.query_params["lesson"] == str(other) and at.query_params["step"] == "1"
        assert _counter(at) == f"step 1 of {len(lesson(other).steps)}"
        assert at.session_state["lesson_lab"][0] == other
    finally:
        _close(at)


def test_a_lesson_whose_extras_are_missing_says_what_to_install(monkeypatch):
    import dplab.lessons.l01_replicas as l01

    monkeypatch.setitem(lesson_runner._EXTRA_MODULES, "mpi", ("dplab_no_such_module",))
    monkeypatch.setattr(l01, "LESSON", dataclasses.replace(L1, needs=("mpi",)))
    at = _app()
    assert [w.value for w in at.warning] == [
        "Lesson 1 needs the mpi extra, not installed here: `pip install -e '.[mpi]'` (from a "
        "checkout), then reload this page."]
    assert not at.get("progress") and "lesson_lab" not in at.session_state  # nothing ran


def test_a_step_that_fails_shows_one_error_and_the_rest_of_the_page(monkeypatch):
    import dplab.lessons.l01_replicas as l01

    def broken(lab):
        raise RuntimeError("the engine disagreed")

    step = Step(
        "Broken", "never shown", broken, checks=(Check("x", lambda f: True),), hint="a hint"
    )
    monkeypatch.setattr(l01, "LESSON", dataclasses.replace(L1, steps=(step, *L1.steps[1:])))
    at = _app()
    try:
        assert [e.value for e in at.error] == ["This step did not run: RuntimeError: the engine "
                                               "disagreed"]
        at.button(key="lesson_next").click().run()  # the next step still runs
        assert not at.error and at.subheader[0].value == f"2. {L1.steps[1].title}"
    finally:
        _close(at)


# --- deep links into the other pages --------------------------------------------------------------

def test_a_deep_link_with_short_names_sets_the_collectives_controls():
    at = _app("pages/collectives.py", algorithm="tree", p="6", n="12")
    assert at.selectbox(key="coll_algorithm").value == "tree"
    assert at.slider(key="coll_p").value == 6 and at.number_input(key="coll_n").value == 12
    assert at.caption[0].value.startswith("round 1 of 6, reduce up the tree")
    query = {k: at.query_params[k] for k in at.query_params}
    assert {"algorithm", "p", "n"}.isdisjoint(query)  # the URL ends up in the page's own names
    assert query["coll_algorithm"] == "tree" and query["coll_p"] == "6"


def test_a_link_into_collectives_later_in_the_session_opens_at_its_round():
    """A learner steps the Collectives page to round 2, leaves, and later follows a lesson's link
    (tree, p=8, no round): the link's picture opens at round 0, not at the round the session
    left."""
    at = _app("pages/collectives.py")
    at.button(key="coll_next").click().run()
    at.button(key="coll_next").click().run()
    assert at.query_params["coll_round"] == "2"
    at.switch_page("pages/home.py").run()
    # what st.page_link(..., query_params=...) puts in the browser's URL: the link's parameters only
    del at.query_params["coll_round"]
    at.query_params.update({"coll_algorithm": "tree", "coll_p": "8"})
    at.switch_page("pages/collectives.py").run()
    assert not at.exception
    assert at.selectbox(key="coll_algorithm").value == "tree" and at.slider(key="coll_p").value == 8
    assert at.caption[0].value.startswith("round 1 of 6, reduce up the tree")
    at.button(key="coll_next").click().run()  # and the buttons still move it
    assert at.caption[0].value.startswith("round 2 of 6") and at.query_params["coll_round"] == "1"


def test_a_deep_link_with_short_names_sets_the_cost_controls():
    at = _app("pages/cost.py", p="4", algorithm="ring,tree")
    assert at.slider(key="cost_world_size").value == 4
    assert list(at.multiselect(key="cost_algorithms").value) == ["ring", "tree"]
    assert at.query_params["world_size"] == "4" and "p" not in at.query_params


# --- the pure helpers -----------------------------------------------------------------------------

def test_position_reads_lesson_and_step_and_clamps():
    lengths = {1: 4, 6: 3}.get
    assert page_view.position({"lesson": "6", "step": "2"}, [1, 6], lengths) == (6, 1)
    assert page_view.position({"lesson": "6", "step": "9"}, [1, 6], lengths) == (6, 2)
    assert page_view.position({"lesson": "2", "step": "0"}, [1, 6], lengths) == (1, 0)
    assert page_view.position({}, [1, 6], lengths) == (1, 0)
    assert page_view.position({"lesson": "x", "step": "y"}, [1, 6], lengths) == (1, 0)
    assert page_view.lessons_link_params(6, 1) == {"lesson": "6", "step": "2"}


def test_check_lines_mark_each_claim():
    out = StepOutcome(
        L1.steps[1], {}, "", (CheckResult("holds", True), CheckResult("fails", False)), 0.0
    )
    assert page_view.check_lines(out) == ["✅ holds", "❌ fails"]


def test_explore_link_translates_short_names_and_names_what_a_page_ignores():
    link = page_view.explore_link(
        Explore("collectives", lambda f: {"algorithm": "ring", "p": f["p"], "bogus": 1}), {"p": 8}
    )
    assert (
        link.file == "pages/collectives.py" and link.label == "Explore this on the Collectives page"
    )
    assert link.params == {"coll_algorithm": "ring", "coll_p": "8", "bogus": "1"}
    assert link.unread == ("bogus",)
    # unknown page
    assert page_view.explore_link(Explore("memory", lambda f: {"x": 1}), {}).unread == ()
    with pytest.raises(ValueError, match="no app page"):
        page_view.explore_link(Explore("nowhere"), {})


def test_adopt_prefers_the_pages_own_name_and_takes_the_first_of_a_list():
    query = {"world_sizes": "2,4", "steps": "5"}
    assert deep_links.adopt(query, "training") == {"world_size": "2"}
    assert query == {"world_size": "2", "steps": "5"}
    query = {"p": "4", "world_size": "6"}
    assert deep_links.adopt(query, "runs") == {} and query == {"world_size": "6"}
    assert deep_links.adopt({"lesson": "1"}, "lessons") == {}


def test_took_reads_at_every_scale():
    assert [page_view.took(s) for s in (1.234, 0.0456, 0.0003)] == ["1.23 s", "46 ms", "0.3 ms"]


def test_is_command_and_needs_line():
    assert page_view.is_command("dplab train --world-size 4")
    assert not page_view.is_command("Change the step's run to all-reduce every 5th step.")
    assert page_view.needs_line(12, ["torch", "mpi"]).startswith(
        "Lesson 12 needs the torch and mpi extras, not installed here: `pip install -e "
        "'.[torch,mpi]'`")
