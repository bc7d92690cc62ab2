"""Plausible wrong answers that an exercise's checker refused for the wrong reason (issue 31: each
checker names the mistake the learner made, not another one with the same symptom).

    pytest -q tests/test_exercise_diagnoses.py
"""

from __future__ import annotations

import textwrap

import pytest

from dplab.lessons.exercises import check_file

WRONG = {
    # a copy where the reduce-scatter must add: it was said to be a chunk short of p - 1 rounds
    "ring-copies": ("ring_reduce_scatter", """
        from dplab.reference.schedule import Schedule, Transfer

        def ring_reduce_scatter(p):
            return Schedule("mine", p, p, [
                tuple(Transfer(r, (r + 1) % p, (r - k - 1) % p, "copy") for r in range(p))
                for k in range(p - 1)])
    """, ["as a copy, which overwrites the partial sum", "op 'reduce'"], ["p - 1 rounds"]),
    # the all-gather before the step: it was said to have no all-gather at all
    "zero2-gather-first": ("zero2_step", """
        from dplab.reference.collectives import allgather, reduce_scatter
        from dplab.reference.schedule import chunk_bounds

        def zero2_step(comm, backward, params, shard, optimizer):
            p, rank = comm.world_size, comm.rank
            for layer, g in backward:
                reduce_scatter(comm, g)
                a, b = chunk_bounds(len(g), p)[rank]
                shard[layer][:] = g[a:b]
            for layer, w in enumerate(params):
                a, b = chunk_bounds(len(w), p)[rank]
                allgather(comm, w)
                optimizer.step(layer, w[a:b], shard[layer])
    """, ["your all-gather carried the chunk as it was before the update", "after optimizer.step"],
        ["no all-gather"]),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_answer_is_refused_naming_its_own_mistake(tmp_path, name):
    exercise, source, says, not_said = WRONG[name]
    file = tmp_path / f"{exercise}.py"
    file.write_text(textwrap.dedent(source))
    report = check_file(exercise, file)
    assert not report.passed
    for phrase in says:
        assert phrase in report.message, report.message
    for phrase in not_said:  # the other mistake's words: a diagnosis of what was not done
        assert phrase not in report.message, report.message
