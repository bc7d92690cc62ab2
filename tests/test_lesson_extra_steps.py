"""Issue 31's items 3 and 6 in the lessons: 10.8 clipping a sharded gradient (10.9 is its exercise,
tests/test_lesson_sharded_clip.py), 6.4 LAMB run against LARS and SGD, 13.6 the batch ramp. The
steps themselves run under ``pytest -m lessons``; these are the cheap checks around them.

    pytest -q tests/test_lesson_extra_steps.py -p no:cacheprovider
"""

from __future__ import annotations

import math

import numpy as np

from dplab.lessons import lesson
from dplab.lessons.coverage import coverage
from dplab.lessons.l06_large_batches import MODEL, lamb_step
from dplab.lessons.l13_batch_size import BASE_BATCH, EPOCHS, FACTOR, N_TRAIN, train_phases
from dplab.reference.model import MLP


def _step(number, title_start):
    return next(s for s in lesson(number).steps if s.title.startswith(title_start))


def test_the_new_steps_teach_their_ideas_where_the_issue_places_them():
    taught = coverage()
    assert [(n, k) for n, k, _ in taught["grad-clipping"]] == [(10, 8), (10, 9)]
    assert [(n, k) for n, k, _ in taught["batch-ramp"]] == [(13, 6)]
    assert (6, 4) in [(n, k) for n, k, _ in taught["lr-scaling"]]
    assert _step(10, "Exercise: clip").exercise == "sharded_clip"


def test_the_clipping_question_names_each_wrong_norm():
    step = _step(10, "Clipping by the global norm")
    norms = [1.0, 2.0, 2.0]
    facts = {"p": 3, "shards": "1, 2, 2", "norm": 3.0, "sum_norms": sum(norms)}
    assert step.predict.judge(facts, "3").correct
    assert step.predict.judge(facts, "3.004").correct  # from the printed four digits
    for reply, says in (("5", "that adds the norms"), ("9", "take its square root"),
                        (f"{3 / math.sqrt(3)}", "that averages the squares")):
        verdict = step.predict.judge(facts, reply)
        assert not verdict.correct and says in verdict.misconception, (reply, verdict)


def test_lamb_moves_every_weight_matrix_by_lr_of_its_norm_and_a_zero_bias_gets_ratio_one():
    model = MLP(MODEL)
    params = model.init_params(0)
    grad = np.random.default_rng(1).standard_normal(model.num_params)
    ratios, moved = lamb_step(params, grad, 0.03)
    assert np.allclose(moved, 0.03, rtol=1e-12, atol=0)
    assert ratios[1::2] == [1.0] * (len(ratios) // 2)  # biases start at 0
    weights = model.param_slices[0::2]
    u = grad / (np.abs(grad) + 1e-8)  # Adam's first direction, bias-corrected
    want = [np.linalg.norm(params[w]) / np.linalg.norm(u[w]) for w in weights]
    assert np.allclose(ratios[0::2], want, rtol=1e-9)


def test_the_lamb_question_is_lr_and_names_a_whole_norm_step():
    step = _step(6, "LAMB, run")
    facts = {"lr_lamb": 0.04, "moved_0": 0.04}
    assert step.predict.judge(facts, "0.04").correct
    assert "a step as long as the tensor" in step.predict.judge(facts, "1").misconception


def test_lesson_6_4_says_who_won_from_its_run_and_cites_the_reality_check():
    text = _step(6, "LAMB, run").text
    for phrase in ("{ranking}", "{momentum:.3f}", "{lars:.3f}", "{lamb:.3f}", "{spread:.1f}x",
                   "Nado et al. (2021)", "You et al. 2020"):
        assert phrase in text, phrase


def test_the_ramp_counts_its_updates_phase_by_phase():
    phases = [(1, 512, 0.05), (1, 1024, 0.05)]
    updates, held_out = train_phases(phases)
    assert updates == N_TRAIN // 512 + N_TRAIN // 1024 and 0 < held_out < 5
    want = sum(e * N_TRAIN // (BASE_BATCH * FACTOR ** i) for i, e in enumerate(EPOCHS))
    step = _step(13, "Ramp the batch")
    hint = step.hints[0].replace("×", "*").replace(",", "")
    assert eval(hint) == want  # noqa: S307 (the hint is arithmetic: it must add up to the run)


def test_the_ramp_question_names_decays_count_and_the_big_batchs():
    step = _step(13, "Ramp the batch")
    facts = {**step.inputs, "updates": 552, "decay_updates": 768, "big_updates": 48}
    assert step.predict.judge(facts, "552").correct
    assert "batch 32 all the way" in step.predict.judge(facts, "768").misconception
    assert "the final batch all the way" in step.predict.judge(facts, "48").misconception
    text = step.text
    assert "Smith et al. (2018)" in text and "GPT-3" in text and "{within:+.1%}" in text


def test_torchs_fsdp_clips_by_an_all_reduce_of_the_squared_shard_norms_as_10_8_says():
    import inspect

    import pytest

    pytest.importorskip("torch")
    from torch.distributed.fsdp import FullyShardedDataParallel

    source = inspect.getsource(FullyShardedDataParallel.clip_grad_norm_)
    assert "local_sharded_norm**norm_type" in source
    assert "dist.all_reduce(total_norm, group=self.process_group)" in source
    assert "total_norm ** (1.0 / norm_type)" in source
    assert "FSDP.clip_grad_norm_ does the same" in _step(10, "Clipping by the global norm").text
