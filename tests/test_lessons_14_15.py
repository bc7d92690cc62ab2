"""Lessons 14 and 15: the model and text they ship, and what their questions say to wrong replies.

    pytest -q tests/test_lessons_14_15.py      # the lessons' own steps run under pytest -m lessons
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from dplab.lessons import lesson  # noqa: E402
from dplab.lessons.chargpt import (  # noqa: E402
    VOCAB,
    CharGPT,
    GPTConfig,
    batch,
    encode,
    matmul_params,
    param_formula,
    text,
)


def test_the_text_is_the_same_every_time_and_uses_only_the_vocabulary():
    assert text() == text.__wrapped__()          # not the cache: generated again, the same
    assert len(text()) == 20_000 and set(text()) <= set(VOCAB)
    assert text(seed=1) != text()


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(layers=1, d=32, heads=2, block=8)])
def test_the_hand_count_is_torchs_count(cfg):
    model = CharGPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_formula(cfg)
    embeddings = (cfg.vocab + cfg.block) * cfg.d
    assert matmul_params(model) == param_formula(cfg) - embeddings


def test_every_rank_draws_the_same_global_batch_and_targets_are_the_next_characters():
    data = encode(text())
    x, y = batch(data, 4, 16, step=3)
    x2, _ = batch(data, 4, 16, step=3)
    assert torch.equal(x, x2) and not torch.equal(x, batch(data, 4, 16, step=4)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_lesson_14_names_the_flops_misconceptions():
    step = lesson(14).steps[0]
    facts = {"n_matmul": 338_592, "flops_per_token": 6 * 338_592}
    assert step.predict.judge(facts, str(6 * 338_592)).correct
    assert "forward pass alone" in step.predict.judge(facts, str(2 * 338_592)).message
    assert "backward alone" in step.predict.judge(facts, str(4 * 338_592)).message
    assert step.asks_before_run()


def test_lesson_14s_gpu_step_says_why_it_did_not_run():
    from dplab.lessons.l14_real_model import on_a_gpu

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the lesson's own run checks that step")
    facts = on_a_gpu(None)
    assert not facts["ran"] and "CUDA" in facts["why"]
    assert math.isclose(facts["mfu_gpu"], 0.0)
