"""Lesson 10's exercise on clipping a sharded gradient by its global norm: the reference clip
against torch's, the stub and solution, and plausible wrong answers each refused by name.

    pytest -q tests/test_lesson_sharded_clip.py -p no:cacheprovider
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from tiers import sampled
from verdicts import verdict

from dplab.backends import launch
from dplab.lessons.exercises import EXERCISES, check_file
from dplab.lessons.exercises.sharded_clip import oracle
from dplab.reference.schedule import chunk_bounds
from dplab.reference.zero.clip import clip_coef, clip_grad_norm

SOLUTION = EXERCISES["sharded_clip"].solution.read_text()
NORM = """    squares = np.array([sum(float(s @ s) for s in shard)])
    allreduce(comm, squares)  # a sum, not a mean: ||g||^2 = sum over ranks of ||g_r||^2
    norm = math.sqrt(squares[0])
"""
CLIP = """    coef = min(1.0, max_norm / (norm + 1e-6))
    for s in shard:
        s *= coef
"""
LOOP = """        reduce_scatter(comm, g)
"""
WHOLE = """    sq = []
    for layer, g in backward:
        whole = g.copy()
        allreduce(comm, whole)  # the whole layer's sum, to take its norm
        sq.append(float(whole @ whole))
        reduce_scatter(comm, g)
"""
BEFORE_RS = """    grads = list(backward)
    norm = math.sqrt(sum(float(g @ g) for _, g in grads))
    for layer, g in grads:
        g *= min(1.0, max_norm / (norm + 1e-6))
        reduce_scatter(comm, g)
"""

# name -> (what replaces what in the solution, a phrase the verdict must contain)
WRONG = {
    "local-shard-norm": ({NORM: "    norm = math.sqrt(sum(float(s @ s) for s in shard))\n"},
                         "each rank clipped by the norm of its own shard"),
    "all-reduced-norms": ({NORM: "    n = np.array([math.sqrt(sum(float(s @ s) for s in shard))])\n"
                                 "    allreduce(comm, n)\n    norm = n[0]\n"},
                          "the shards' NORMS were all-reduced, but norms do not add"),
    "no-sqrt": ({NORM: NORM.replace("math.sqrt(squares[0])", "squares[0]")},
                "the square root is missing"),
    "averaged": ({NORM: NORM.replace("allreduce(comm, squares)",
                                     "allreduce(comm, squares, op='mean')")},
                 "the all-reduce averaged them (op='mean') where it must sum"),
    "averaged-norms": ({NORM: "    n = np.array([math.sqrt(sum(float(s @ s) for s in shard))])\n"
                              "    allreduce(comm, n, op='mean')\n    norm = n[0]\n"},
                       "the mean of the shards' norms"),
    # DDP's habit kept under ZeRO: clip this rank's own gradient, then reduce-scatter it
    "before-the-reduce-scatter": ({"    for layer, g in backward:\n" + LOOP: BEFORE_RS,
                                   NORM + CLIP: ""},
                                  "scaled before the reduce-scatter summed the ranks' gradients"),
    "inside-the-loop": ({"        del g\n": "        del g\n" + "\n".join(
        "    " + line if line else line for line in (NORM + CLIP).splitlines()) + "\n", CLIP: ""},
                        "clipped before every layer's reduce-scatter had completed"),
    "layer-by-layer": ({NORM + CLIP: "    for s in shard:\n        sq = np.array([float(s @ s)])\n"
                                     "        allreduce(comm, sq)\n"
                                     "        s *= min(1.0, max_norm / (math.sqrt(sq[0]) + 1e-6))\n"
                                     "    squares = np.array([sum(float(s @ s) for s in shard)])\n"
                                     "    allreduce(comm, squares)\n"
                                     "    norm = math.sqrt(squares[0])\n"},
                       "each layer was clipped by its own norm"),
    "unclamped": ({"min(1.0, max_norm / (norm + 1e-6))": "max_norm / (norm + 1e-6)"},
                  "scaled UP by"),
    "all-reduces-the-gradient": ({"    for layer, g in backward:\n" + LOOP: WHOLE,
                                  NORM: "    norm = math.sqrt(sum(sq))\n"},
                                 "all-reduce ONE number per rank"),
    "returns-the-clipped-norm": ({"    return norm": "    return norm * coef"},
                                 "the chunks are right, but rank 0 returned"),
}


def _wrong(tmp_path, changes):
    source = SOLUTION
    for old, new in changes.items():
        assert old in source, old
        source = source.replace(old, new, 1)
    file = tmp_path / "sharded_clip.py"
    file.write_text(source)
    return file


def test_the_solution_passes_and_the_stub_fails_naming_the_common_bug():
    right = verdict("sharded_clip", EXERCISES["sharded_clip"].solution)
    assert right.passed, right.message
    assert "torch.nn.utils.clip_grad_norm_ gives on one device" in right.message
    stub = verdict("sharded_clip", EXERCISES["sharded_clip"].stub_path)
    assert not stub.passed, stub.message
    assert "each rank clipped by the norm of its own shard" in stub.message, stub.message


# a wrong norm and a clip in the wrong place (the stub's own-shard norm is the test above); the
# other nine in the slow tier: each is a child process with its own ranks
@pytest.mark.parametrize("name", sampled(sorted(WRONG),
                                         keep={"all-reduced-norms", "before-the-reduce-scatter"}))
def test_a_wrong_clip_is_refused_by_name(tmp_path, name):
    changes, says = WRONG[name]
    report = check_file("sharded_clip", _wrong(tmp_path, changes))
    assert not report.passed, name
    assert says in report.message, report.message


def _sharded(comm, grad, max_norm):
    p, r = comm.world_size, comm.rank
    cuts = [chunk_bounds(len(g), p)[r] for g in grad]
    mine = [g[a:b].copy() for g, (a, b) in zip(grad, cuts)]
    return clip_grad_norm(comm, mine, max_norm), mine


@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_the_reference_clip_on_shards_is_torchs_on_the_whole_gradient(max_norm):
    rng = np.random.default_rng(0)
    grad = [rng.standard_normal(n) for n in (7, 1, 13, 0, 4)]
    total, clipped = oracle(grad, max_norm)
    assert math.isclose(total, float(np.linalg.norm(np.concatenate(grad))), rel_tol=1e-14)
    for p in (1, 2, 3, 5):
        results = launch(_sharded, p, args=(grad, max_norm))
        for r, (norm, mine) in enumerate(results):
            assert math.isclose(norm, total, rel_tol=1e-13)
            for g, c in zip(mine, clipped):
                a, b = chunk_bounds(len(c), p)[r]
                np.testing.assert_allclose(g, c[a:b], rtol=1e-13, atol=0)


def test_torchs_coefficient_is_the_references():
    torch = pytest.importorskip("torch")
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    t = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    t.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([t], 1.0)
    assert float(t.grad[0]) == 3.0 * clip_coef(5.0, 1.0)
    assert clip_coef(5.0, 10.0) == 1.0


def test_the_lessons_readme_counts_these_wrong_answers():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "lessons" / "README.md").read_text()
    words = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen"}
    said = f"clip_grad_norm_` on one device; {words[len(WRONG)]} plausible wrong"
    assert said in " ".join(readme.split())
