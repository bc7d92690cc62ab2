"""Lessons 1-4: their exercises' wrong answers are named, and their claims rest on what is
deterministic.

    pytest -q -p no:cacheprovider tests/test_lessons_1_4.py

Each exercise of the ladder's bottom (the ring all-gather, the tree broadcast) has a set of
plausible wrong answers; every one must fail with a sentence that names its mistake, and the
template they are made from must pass when filled right (so each differs only where it says).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from tiers import sampled
from verdicts import verdict

from dplab.lessons import lesson
from dplab.lessons.exercises import EXERCISES, SOLUTIONS, STUBS, check_file, ring_allgather, tree


def _write(tmp_path: Path, name: str, source: str) -> Path:
    file = tmp_path / f"{name}.py"
    file.write_text(textwrap.dedent(source))
    return file


ALLGATHER = """
    from dplab.reference.schedule import Schedule, Transfer

    def ring_allgather(p):
        return Schedule("mine", p, p, [tuple(Transfer(r, {dst}, {chunk}, "{op}") for r in range(p))
                                       for k in range({rounds})])
"""
RIGHT_ALLGATHER = {"dst": "(r + 1) % p", "chunk": "(r - k) % p", "op": "copy", "rounds": "p - 1"}

BROADCAST = """
    import math
    from dplab.reference.schedule import Schedule, Transfer

    def tree_broadcast(p, root=0):
        steps = [1 << i for i in range({count})]
        rounds = []
        for s in {order}:
            rounds.append([Transfer({src}, {dst}, 0, "{op}") for v in range(0, {top}, 2 * s)])
        return Schedule("mine", p, 1, rounds)
"""
RIGHT_BROADCAST = {"count": "(p - 1).bit_length()", "order": "reversed(steps)", "src": "(v + root) "
                                                                                       "% p",
                   "dst": "(v + s + root) % p", "op": "copy", "top": "p - s"}

WRONG = [
    # the ring all-gather
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "chunk": "(r - k - 1) % p"},
        "at p=2: in round 0 rank 0 sends chunk 1, which it does not hold complete (it has rank 0's "
        "part only), so rank 1 is left with a partial chunk: that is the reduce-scatter's rule, (r "
        "- k - 1) mod p",
    ),
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "chunk": "(r + k) % p"},
        "at p=3: in round 1 rank 0 sends chunk 1, which it does not hold complete (it has ranks 0 "
        "and 2's parts only), so rank 1 is left with a partial chunk: pass on what arrived in the "
        "round before (chunk 2, from rank 2)",
    ),
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "dst": "(r - 1) % p"},
        "at p=3: in round 0 rank 0 sends to rank 2: in the ring each rank sends only to its right "
        "neighbour, (r + 1) mod p = 1",
    ),
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "rounds": "max(p - 2, 0)"},
        "at p=2: rank 0 ends without chunk 1 complete with no rounds: it holds 1 of the 2 chunks. "
        "A rank lacks p - 1 chunks and receives one a round, so the all-gather takes p - 1 = 1 "
        "rounds",
    ),
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "op": "reduce"},
        "at p=2: in round 0 rank 1 adds chunk 0 from rank 0: in the all-gather every chunk sent is "
        "already complete, so the receiver copies it ('copy')",
    ),
    (
        "ring_allgather",
        ALLGATHER,
        {**RIGHT_ALLGATHER, "rounds": "p if p > 1 else 0"},
        "at p=2: in round 1 rank 0 sends chunk 1 to rank 1, which already holds it complete: a "
        "wasted send",
    ),
    # the tree broadcast
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "order": "steps"},
        "at p=4, root=0: in round 0 rank 2 sends before it holds the root's buffer: your rounds "
        "run in the reduce's order (smallest step first)",
    ),
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "src": "v", "dst": "v + s"},
        "at p=5, root=2: in round 0 rank 0 sends before it holds the root's buffer: your tree "
        "broadcasts from rank 0, not from root 2; number the ranks from the root, v = (r - root) "
        "mod p",
    ),
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "count": "int(math.log2(p))"},
        "at p=3, root=0: rank 2 never receives the root's buffer (1 of 3 ranks lacks it after the "
        "last round (round 0)): each round at most doubles the holders (1, 2, 4, ...), so p = 3 "
        "needs ceil(lg p) = 2 rounds, lg p rounded up",
    ),
    # written for powers of two: at p = 3 rank 2's partner would be rank 3
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "src": "v", "dst": "v + s", "top": "p"},
        (
            "tree_broadcast(3, 0) raised ScheduleError",
            "is out of range (p=3, k=1)",
            "a rank whose partner would be p or more sits that round out",
        ),
    ),
    # the same, wrapped round with mod p: the partner past the end is a rank that has it already
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "top": "p"},
        "at p=3, root=0: in round 1 rank 2 sends to rank 0, which already holds the root's buffer: "
        "a wasted send",
    ),
    (
        "tree_broadcast",
        BROADCAST,
        {**RIGHT_BROADCAST, "op": "reduce"},
        "at p=2, root=0: in round 0 rank 1 adds what rank 0 sends: a broadcast copies the root's "
        "buffer",
    ),
    # the root sends to everyone itself: one round, p - 1 messages through one port
    (
        "tree_broadcast",
        BROADCAST,
        {
            **RIGHT_BROADCAST,
            "count": "1 if p > 1 else 0",
            "src": "root",
            "dst": "(root + v // 2 + 1) % p",
            "top": "2 * (p - 1)",
            "order": "[1] if p > 1 else []",
        },
        "at p=3, root=0: in round 0 rank 0 sends 2 messages: a rank sends one message a round (one "
        "port",
    ),
    # a chain: each rank passes it to the next, p - 1 rounds
    (
        "tree_broadcast",
        BROADCAST,
        {
            **RIGHT_BROADCAST,
            "order": "range(1, p)",
            "src": "(s - 1 + root) % p",
            "dst": "(s + root) % p",
            "top": "1",
        },
        "at p=4, root=0: every rank gets the root's buffer, but in 3 rounds: a binomial tree needs "
        "ceil(lg p) = 2",
    ),
]


# the reduce-scatter's chunk rule, a round short, the reduce's order, the powers-of-two tree that
# raises; the other ten in the slow tier (a child process each)
@pytest.mark.parametrize("name, template, fill, says", sampled(
    WRONG, keep={"ring_allgather-0", "ring_allgather-3", "tree_broadcast-6", "tree_broadcast-9"},
    ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)]))
def test_a_plausible_wrong_answer_fails_naming_its_mistake(tmp_path, name, template, fill, says):
    report = check_file(name, _write(tmp_path, name, template.format(**fill)))
    assert not report.passed, report.message
    for part in (says,) if isinstance(says, str) else says:
        assert part in report.message, report.message


@pytest.mark.parametrize("name, template, fill", [("ring_allgather", ALLGATHER, RIGHT_ALLGATHER),
                                                  ("tree_broadcast", BROADCAST, RIGHT_BROADCAST)])
def test_the_wrong_answers_templates_pass_when_filled_right(tmp_path, name, template, fill):
    report = check_file(name, _write(tmp_path, name, template.format(**fill)))
    assert report.passed, report.message


@pytest.mark.parametrize(
    "name, says",
    [
        (
            "ring_allgather",
            "at p=3: rank 0 ends without chunk 1 complete after the last round (round 0)",
        ),
        ("tree_broadcast", "at p=3, root=0: rank 2 never receives the root's buffer"),
    ],
)
def test_the_new_stubs_fail_and_solutions_pass(name, says):
    exercise = EXERCISES[name]
    assert exercise.lesson == 2 and exercise.stub_path.parent == STUBS
    stub = verdict(name, exercise.stub_path)
    assert not stub.passed and says in stub.message, stub.message
    solved = verdict(name, SOLUTIONS / exercise.stub)
    assert solved.passed, solved.message


def test_the_hints_climb_in_two_or_three_tiers_and_the_last_is_nearly_the_line():
    for hints, line in ((ring_allgather.HINTS, "(r - k) mod p"), (tree.HINTS, "Transfer((v + root) "
                                                                              "% p")):
        assert 2 <= len(hints) <= 3
        assert line in hints[-1] and not any(line in h for h in hints[:-1])


# --- the lessons' content: what issue 22 found wrong stays fixed ----------------------------------

def _step(number, title_start):
    from dplab.lessons import lesson
    return next(s for s in lesson(number).steps if s.title.startswith(title_start))


def _words(step):
    """Everything a learner reads of a step before it is filled: text, question, checks, hints."""
    parts = [step.text, *step.all_hints(), *(c.claim for c in step.checks)]
    if step.predict is not None:
        parts.append(step.predict.question)
        parts.extend(why for _, why in step.predict.misconceptions)
    return "\n".join(parts)


def test_the_latency_steps_explore_link_takes_beta_from_the_fact_the_text_shows():
    from dplab.lessons.runner import Lab, run_step
    step = _step(2, "The trade-off")
    with Lab() as lab:
        out = run_step(step, lab, figure=False)
    assert out.facts["gbps"] == pytest.approx(12.5)
    assert float(step.explore.query(out.facts)["beta_gbps"]) == out.facts["gbps"]
    assert "12.5 GB/s" in out.text
    # and the Cost page offers that β: a value off its slider would open the page at its default
    import ast

    import dplab.viz
    page = (Path(dplab.viz.__file__).parent / "pages" / "cost.py").read_text()
    offered = next(
        ast.literal_eval(node.value)
        for node in ast.parse(page).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BETA_GBPS"
    )
    assert out.facts["gbps"] in offered


def test_the_minimum_bytes_claim_names_in_network_reduction():
    words = _words(_step(2, "Naive, ring, tree"))
    assert "the minimum for any all-reduce" not in words
    assert "only carries bytes" in words and "NVLS" in words and "SHARP" in words


def test_the_topology_step_does_not_make_hierarchical_an_artifact_of_one_ring():
    words = _words(_step(2, "Topology"))
    assert "ring per NIC" in words and "trees" in words and "NVLS" in words
    words3 = _words(_step(3, "The cheapest all-reduce per region"))
    assert "registry" in words3 and "ring per NIC" in words3


def test_lessons_1_to_4_say_mib_not_mb():
    import re

    from dplab.lessons import lesson
    for number in (1, 2, 3, 4):
        for step in lesson(number).steps:
            assert not re.search(r"\bMB\b", _words(step)), (number, step.title)


def test_questions_come_first_and_the_shown_code_does_not_hold_the_answer():
    from dplab.lessons import lesson
    for number in (1, 2, 3, 4):
        for step in lesson(number).steps:
            if step.predict is None:
                continue
            assert step.asks_before_run(), (number, step.title)
    assert "2 * (p - 1) * n // p" not in _step(2, "Bytes on the wire").code()
    assert "1 / 10" not in _step(1, "Data parallelism is large-batch SGD").code()
    exercise = _step(2, "Exercise: the ring reduce-scatter")
    assert "r - k - 1" not in exercise.text and "r-k-1" not in exercise.text
    assert "r - k - 1" not in exercise.code()  # the stub, not the engine's ring


def test_every_exercise_step_shows_its_stub_and_climbs_in_tiers():
    from dplab.lessons import lesson
    for number in (2, 4):
        for step in lesson(number).steps:
            if step.exercise in (
                "ring_reduce_scatter",
                "ring_allgather",
                "tree_broadcast",
                "ddp_buckets",
            ):
                assert f"stubs.{step.exercise}" in step.code(), step.title
                assert len(step.all_hints()) >= 2, step.title


def test_a_reply_of_one_over_p_is_named_torchs_convention():
    from dplab.lessons.runner import Lab, run_step
    step = _step(1, "Data parallelism is large-batch SGD")
    with Lab() as lab:
        out = run_step(step, lab, figure=False)
    verdict = step.predict.judge(out.facts, "0.25")
    assert not verdict.correct and "torch DDP's convention" in verdict.misconception
    assert step.predict.judge(out.facts, "1/10").correct


def test_a_measured_order_is_claimed_only_when_every_paired_repetition_agrees():
    from dplab.lessons.l03_cost import _measured
    assert "faster in every repetition" in _measured(1.4, 3.0, 6, 2)
    assert "the ring was faster" in _measured(0.5, 0.9, 6, 2)
    said = _measured(0.8, 1.6, 6, 2)
    assert "disagree" in said and "claims no order" in said


def test_no_step_shows_an_exercises_answer_before_the_exercise():
    """The code a step shows, and the code of every step before it, holds no exercise's solution."""
    from dplab.lessons import lesson
    from dplab.lessons.exercises import EXERCISES, SOLUTIONS
    answers = {"ring_reduce_scatter": "(r - k - 1) % p", "ring_allgather": "(r - k) % p",
               "tree_broadcast": "reversed(_edges", "ddp_buckets": "size >= cap"}
    for number in (1, 2, 3, 4):
        steps = lesson(number).steps
        for i, step in enumerate(steps):
            later = {s.exercise for s in steps[i:] if s.exercise in answers}
            for name in later:
                assert answers[name] not in step.code(), (number, step.title, name)
                assert (SOLUTIONS / EXERCISES[name].stub).read_text() not in step.code()


# the fresh reader's report: terms defined before they are asked about, one way to say a number
def test_lesson_1_says_per_rank_batch_times_p():
    text = lesson(1).steps[1].text
    assert "micro-batch" not in text and "per-rank batch × p" in text


def test_lesson_2_and_3_questions_define_the_schedules_they_offer():
    q2 = lesson(2).steps[3].predict.question
    assert (
        "double_tree: NCCL's two binary trees" in q2
        and "hierarchical:4: a ring inside groups" in q2
    )
    assert "{dt_path} α" in lesson(2).steps[3].text
    q3 = lesson(3).steps[3].predict.question
    assert all(
        name in q3 for name in ("direct", "pipelined_tree", "pipelined_ring", "hierarchical:8")
    )


def test_lesson_2_double_trees_path_sums_each_rounds_busiest_port():
    from dplab.lessons.l02_allreduce import schedules_compared
    facts = schedules_compared(None)
    assert facts["by"]["double_tree"]["alphas"] == facts["dt_path"] == 38


def test_lesson_3_gives_the_crossover_in_bytes_and_kib():
    assert "{rd_below_bytes:,.0f} bytes ({rd_below_kib:.0f} KiB)" in lesson(3).steps[2].text


def test_lesson_3_says_what_the_fit_did_with_beta_and_gamma():
    """3.2 said one fit may put the per-byte cost in β and the next in γ; 3 runs of 3 set β = 0."""
    from dplab.lessons.l03_cost import zero_said
    text = lesson(3).steps[1].text
    assert "the next in γ" not in text and "{zero_said}" in text and "{alike:.3f}" in text
    assert zero_said(["β"]).startswith("β came out exactly 0") and "to γ" in zero_said(["β"])
    assert "to β" in zero_said(["γ"]) and "to α" in zero_said(["β", "γ"])
    assert zero_said([]) == "Both per-byte terms came out positive."


def test_lesson_2_says_why_nccl_runs_the_double_tree_from_its_own_count():
    """2.4 charged the double tree 38 α against the ring's 14 at p = 8 without saying why NCCL uses
    it."""
    from dplab.reference.costfit import terms
    text = lesson(2).steps[3].text
    assert (
        "{dt_64} α against the ring's {ring_64}" in text and "{dt_256}" in text and "lg p" in text
    )
    dt, ring = terms("double_tree", 64, 1 << 20)[0], terms("ring", 64, 1 << 20)[0]
    assert dt < ring == 126


def test_lesson_2_says_ncclss_channels_run_at_once():
    """2.7's 420 µs queued all 8 rings through one port; NCCL's channels run concurrently."""
    text = lesson(2).steps[6].text
    assert (
        "channels run at once" in text and "{channel_small_us:.0f} µs" in text and "queues" in text
    )


def test_lesson_3_says_the_share_hierarchical_keeps_on_nvlink_from_its_schedule():
    """3.4 said the hierarchical all-reduce 'keeps 7/8 of them on NVLink'; its schedule keeps 8/9
    of its bytes inside the nodes at 64 GPUs (14/15 at 16): the share is filled from the
    schedule."""
    from dplab.reference.algorithms import allreduce_schedule
    from dplab.reference.columns import columns

    text = lesson(3).steps[3].text
    assert "7/8" not in text and "{nvlink_64:.0%}" in text and "1/{g} piece" in text
    t = columns(allreduce_schedule("hierarchical:8", 64))
    assert abs((t.src // 8 == t.dst // 8).mean() - 8 / 9) < 1e-12
    assert any("8/9" in c.claim for c in lesson(3).steps[3].checks)


def test_lesson_4_says_what_model_it_simulates_rather_than_lesson_5s():
    """4.2 ran 'lesson 5's transformer' on a DGX node, a model the learner meets a lesson later,
    with its 1,024 tokens typed by hand: the step now says what the model is, from its facts."""
    from dplab.lessons.l04_buckets import _dgx_facts

    text = lesson(4).steps[1].text
    assert "lesson 5's transformer" not in text and "1,024 tokens" not in text
    assert "{dgx_tokens:,} tokens" in text and "{dgx_params:,}" in text
    f = _dgx_facts()
    assert f["dgx_params"] == f["dgx_blocks"] * 12 * f["dgx_width"] ** 2
    assert f["dgx_grads"] == 2 * f["dgx_params"]      # bfloat16 gradients


def test_lesson_2_gives_the_dgx_links_from_the_cluster_files_not_by_hand():
    """2.7's text and 2.9's question typed NVLink's 450 GB/s and the NIC's 50 GB/s: they are now
    the preset's and the simulated cluster's, which the steps' runs price with."""
    import math

    from dplab.lessons.l02_allreduce import DGX_GBPS
    from dplab.reference.cluster import cluster

    c = cluster("dgx-h100x2")
    assert math.isclose(DGX_GBPS["dgx_nvlink_gbps"], 1e-9 / c.intra.beta, rel_tol=1e-12)
    assert math.isclose(DGX_GBPS["dgx_nic_gbps"], 1e-9 / c.inter.beta, rel_tol=1e-12)
    steps = lesson(2).steps
    assert "450" not in steps[6].text and "{dgx_nvlink_gbps:.0f} GB/s" in steps[6].text
    question = steps[8].predict.question
    assert "450" not in question and "{dgx_nic_gbps:.0f} GB/s NIC" in question
    assert steps[8].asks_before_run() and steps[6].asks_before_run()
