"""Lessons 9-12's exercises and claims: every stub fails, every solution passes, and plausible wrong
answers fail with a sentence that names their mistake.

    pytest -q tests/test_lessons_9_12.py
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dplab.lessons.exercises import EXERCISES, SOLUTIONS, check_file

ZERO2_HEAD = """
    import numpy as np
    from dplab.reference.collectives import allgather, allreduce, reduce_scatter
    from dplab.reference.schedule import chunk_bounds

    def zero2_step(comm, backward, params, shard, optimizer):
        p, rank = comm.world_size, comm.rank
"""
ZERO2_TAIL = """
        for layer, w in enumerate(params):
            a, b = chunk_bounds(len(w), p)[rank]
            optimizer.step(layer, w[a:b], shard[layer])
            allgather(comm, w)
"""
ZERO2_WRONG = {
    # ZeRO-1's pattern: every layer's gradient first, the reduce-scatters after backward
    "zero1-pattern": ("""
        grads = dict(backward)
        for layer, g in grads.items():
            reduce_scatter(comm, g)
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer][:] = g[a:b]
    """, ["whole gradient", "stayed alive until after backward", "ZeRO-1's pattern"]),
    # one whole-vector reduce-scatter after backward
    "whole-vector": ("""
        full = np.concatenate([g for _, g in sorted(backward)])
        reduce_scatter(comm, full)
        for layer, w in enumerate(params):
            a, b = chunk_bounds(len(w), p)[rank]
            start = sum(len(v) for v in params[:layer])
            shard[layer][:] = full[start + a:start + b]
    """, ["whole gradient", "ZeRO-1's pattern"]),
    # the old exercise's passing wrong answer: all-reduce, step the own chunk, all-gather
    "allreduce": ("""
        for layer, g in backward:
            allreduce(comm, g)
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer][:] = g[a:b]
            del g
    """, ["at p=2: in step 0 the ranks sent 1.50x the bytes of ZeRO-2", "allreduce 16x",
          "reduce_scatter sends half of an all-reduce's bytes"]),
    # a view kept in the shard keeps the whole buffer alive
    "view": ("""
        for layer, g in backward:
            reduce_scatter(comm, g)
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer] = g[a:b]
    """, ["is a view into layer", "a slice keeps all of g alive"]),
    # the chunk stepped, but no all-gather
    "no-allgather": ("""
        for layer, g in backward:
            reduce_scatter(comm, g)
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer][:] = g[a:b]
        for layer, w in enumerate(params):
            a, b = chunk_bounds(len(w), p)[rank]
            optimizer.step(layer, w[a:b], shard[layer])
        return
    """, ["no all-gather brought the update"]),
    # averaged where the ranks' gradients must be summed
    "averaged": ("""
        for layer, g in backward:
            reduce_scatter(comm, g)
            a, b = chunk_bounds(len(g), p)[rank]
            shard[layer][:] = g[a:b] / p
    """, ["moved 1/2 as far as on one device: the gradient was averaged"]),
}


def _file(tmp_path: Path, name: str, body: str, tail: str) -> Path:
    file = tmp_path / f"{name}.py"
    file.write_text(textwrap.dedent(ZERO2_HEAD) + textwrap.indent(textwrap.dedent(body), "    ")
                    + textwrap.indent(textwrap.dedent(tail), "    "))
    return file


def test_zero2_solution_passes_on_values_bytes_and_memory():
    report = check_file("zero2_step", SOLUTIONS / "zero2_step.py")
    assert report.passed, report.message
    assert "one reduce-scatter and one all-gather per layer" in report.message


def test_zero2_stub_fails_naming_its_mistake():
    report = check_file("zero2_step", EXERCISES["zero2_step"].stub_path)
    assert not report.passed
    assert "whole gradient" in report.message and "ZeRO-1's pattern" in report.message, report.message


@pytest.mark.parametrize("name", sorted(ZERO2_WRONG))
def test_zero2_wrong_answers_fail_naming_the_mistake(tmp_path, name):
    body, says = ZERO2_WRONG[name]
    tail = "" if body.rstrip().endswith("return") else ZERO2_TAIL
    report = check_file("zero2_step", _file(tmp_path, "zero2_step", body, tail))
    assert not report.passed
    for phrase in says:
        assert phrase in report.message, report.message
