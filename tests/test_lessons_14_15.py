"""Lessons 14 and 15: the model and text they ship, and what their questions say to wrong replies.

    pytest -q tests/test_lessons_14_15.py      # the lessons' own steps run under pytest -m lessons
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tiers import sampled  # noqa: E402

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


# --- lesson 15's exercise: DDP from hooks on torch tensors ----------------------------------------

HOOKS = """
    import torch
    import torch.distributed as dist

    def attach_ddp_hooks(model):
        world = dist.get_world_size()
        handles = []

        def hook(param):
{hook}

        for param in model.parameters():
            if {which}:
                param.register_post_accumulate_grad_hook(hook)

        def finish():
{finish}

        return finish
"""
RIGHT_HOOK = """            param.grad.div_(world)
            handles.append(dist.all_reduce(param.grad, async_op=True))"""
RIGHT_FINISH = """            for h in handles:
                h.wait()
            handles.clear()"""
ALL = "param.requires_grad"

# a plausible wrong answer -> (hook, which, finish) and what the report must say
HOOKS_WRONG = {
    "no-divide": (
        (
            "            handles.append(dist.all_reduce(param.grad, async_op=True))",
            ALL,
            RIGHT_FINISH,
        ),
        [
            "moved 2 times as far as one process's",
            "summed, not averaged",
            "divide each gradient by the world size (2)",
        ],
    ),
    "divide-twice": (
        (
            "            param.grad.div_(world)\n"
            "            handles.append(dist.all_reduce(param.grad, async_op=True))",
            ALL,
            "            for h in handles:\n                h.wait()\n            handles.clear()\n"
            "            for p in model.parameters():\n                p.grad.div_(world)",
        ),
        ["moved 1/2 as far", "divided by the world size twice"],
    ),
    "wait-in-hook": (
        (
            "            param.grad.div_(world)\n"
            "            dist.all_reduce(param.grad, async_op=True).wait()",
            ALL,
            "            pass",
        ),
        ["waited for each all-reduce inside its hook, before the next one was launched"],
    ),
    "blocking": (
        (
            "            param.grad.div_(world)\n            dist.all_reduce(param.grad)",
            ALL,
            "            pass",
        ),
        ["blocking (async_op=False)", "no communication overlapped the backward"],
    ),
    "data-not-grad": (
        (
            "            handles.append(dist.all_reduce(param.data, async_op=True))",
            ALL,
            RIGHT_FINISH,
        ),
        ["all-reduced 4.bias (2,)'s values (param.data), not its gradient (param.grad)"],
    ),
    "a-copy": (
        (
            "            g = param.grad / world\n"
            "            handles.append(dist.all_reduce(g, async_op=True))",
            ALL,
            RIGHT_FINISH,
        ),
        ["not any parameter's .grad (a copy", "All-reduce param.grad itself"],
    ),
    "weights-only": (
        (RIGHT_HOOK, "param.dim() > 1", RIGHT_FINISH),
        [
            "in step 0 0.bias (16,)'s gradient was never all-reduced (3 of 6 parameters were not)",
            "Register the hook on every parameter",
        ],
    ),
    "never-waits": (
        (RIGHT_HOOK, ALL, "            handles.clear()"),
        [
            "finish() waited for 0 of the 6 all-reduces launched in step 0",
            "Wait for every handle in finish()",
        ],
    ),
    # issue 31: these passed, reported as "all-reduced from its hook while backward ran", with no
    # overlap
    "launch-from-last-hook": (
        (
            "            handles.append(param)\n"
            "            n = sum(p.requires_grad for p in model.parameters())\n"
            "            if len(handles) == n:\n"
            "                for p in handles:\n"
            "                    p.grad.div_(world)\n"
            "                handles[:] = [dist.all_reduce(p.grad, async_op=True)\n"
            "                              for p in handles]",
            ALL,
            RIGHT_FINISH,
        ),
        [
            "0 of 6 started while other gradients were still to come",
            "nothing overlapped backward",
            "its own parameter's hook",
        ],
    ),
    "launch-in-finish": (
        (
            "            pass",
            ALL,
            "            for p in model.parameters():\n"
            "                p.grad.div_(world)\n"
            "                handles.append(dist.all_reduce(p.grad, async_op=True))\n"
            "            for h in handles:\n                h.wait()\n"
            "            handles.clear()",
        ),
        [
            "6 of the 6 all-reduces were launched in finish(), after backward had ended",
            "none of that communication overlapped backward",
        ],
    ),
}


def _hooks_file(tmp_path, hook, which, finish):
    import textwrap

    file = tmp_path / "ddp_hooks.py"
    filled = HOOKS.replace("{hook}", hook).replace("{which}", which).replace("{finish}", finish)
    file.write_text(textwrap.dedent(filled))
    return file


def test_the_hooks_template_filled_right_passes_and_so_does_the_shipped_solution(tmp_path):
    from dplab.lessons.exercises import SOLUTIONS, check_file

    for file in (_hooks_file(tmp_path, RIGHT_HOOK, ALL, RIGHT_FINISH), SOLUTIONS / "ddp_hooks.py"):
        report = check_file("ddp_hooks", file)
        assert report.passed, report.message
        assert "waited for in finish()" in report.message
        assert (
            "5 of the 18 all-reduces started while backward still had gradients to make"
            in report.message
        )


# one judged by its values, one by its log of all-reduces; the other eight in the slow tier (each
# is a child process that imports torch and starts two gloo ranks)
@pytest.mark.parametrize("name", sampled(sorted(HOOKS_WRONG), keep={"no-divide", "wait-in-hook"}))
def test_a_plausible_wrong_ddp_from_hooks_fails_naming_its_mistake(tmp_path, name):
    from dplab.lessons.exercises import check_file

    (hook, which, finish), says = HOOKS_WRONG[name]
    report = check_file("ddp_hooks", _hooks_file(tmp_path, hook, which, finish))
    assert not report.passed, name
    for phrase in says:
        assert phrase in report.message, (name, report.message)


def test_lesson_15s_questions_name_their_misconceptions_and_no_step_shows_the_hooks_answer():
    from dplab.lessons.exercises import SOLUTIONS

    steps = lesson(15).steps
    hooks, sampler, bn, local = steps[0], steps[1], steps[2], steps[4]
    assert "single bucket" in hooks.predict.judge({"tensors": 6, "per_backward": 6}, "1").message
    assert (
        "pads to a multiple" in sampler.predict.judge({"n": 10, "p": 4, "handed": 12}, "10").message
    )
    assert "drop_last=True" in sampler.predict.judge({"n": 10, "p": 4, "handed": 12}, "8").message
    assert (
        "rank 0's own mean"
        in bn.predict.judge({"m0": -2.0, "m1": 2.0, "global_mean": 0.0}, "-2").message
    )
    assert "only how often" in local.predict.judge({"h": 4, "ratio": 0.25}, "0.5").message
    assert all(s.asks_before_run() for s in (hooks, sampler, bn, local))
    answer = (SOLUTIONS / "ddp_hooks.py").read_text()
    assert "handles.append(dist.all_reduce(param.grad, async_op=True))" in answer
    for step in steps:
        assert "dist.all_reduce(param.grad, async_op=True))" not in step.code(), step.title
    assert len(hooks.all_hints()) == 3


# the fresh reader's report: PowerSGD's rank is a matrix's, and a distance of 0 reads as exact
def test_lesson_15_says_matrix_rank_and_exactly():
    steps = lesson(15).steps
    assert "matrix rank 1" in steps[3].text and "at rank 1" not in steps[3].text
    assert "matrix rank 1" in steps[3].hint
    assert "{synced_diff:diff}" in steps[2].text


# issue 31: the teacher's errors in lesson 14 stay fixed
def test_the_wait_splits_into_the_other_ranks_lag_and_the_all_reduce():
    """14.4 called the whole wait 'what backward did not hide';
    part of it was the other rank's lag."""
    from dplab.lessons.l14_real_model import split_wait
    ms = 1_000_000
    rank0 = [("wait", 0, 10 * ms, 0, "main"), ("wait", 100 * ms, 103 * ms, 0, "main")]
    rank1 = [("wait", 4 * ms, 10 * ms, 0, "main"), ("wait", 99 * ms, 103 * ms, 0, "main")]
    lag, rest = split_wait([(rank0, []), (rank1, [])])
    assert lag == [4.0, 0.0] and rest == [6.0, 3.0]   # rank 1 late by 4 ms, then early
    text = lesson(14).steps[3].text
    assert "what backward did not hide is the wait" not in text and "{lag_ms:.2g}" in text


def test_lesson_14s_gpu_hint_counts_the_tokens_its_step_runs():
    from dplab.lessons.l14_real_model import BLOCK, GPU_ROWS, WIDTH
    cfg = GPTConfig()
    assert (BLOCK, WIDTH) == (cfg.block, cfg.d)
    hint = lesson(14).steps[4].hint
    assert (
        "512 tokens" not in hint
        and f"{GPU_ROWS * cfg.block:,} tokens" in hint
        and str(cfg.d) in hint
    )


def test_lesson_14_calls_its_utilisation_by_what_it_divides_by():
    step = lesson(14).steps[2]
    assert (
        "matmul utilisation" in step.text and "384 × 384" in step.text and "one thread" in step.text
    )
    assert "**MFU" not in step.text and "MFU" not in step.title


def test_attention_flops_per_token_are_what_torch_counts_for_the_attention_products():
    """chargpt's count said the full square, 2 · 2 · block · d forward per layer and three times
    that with backward, but returned half of it: 14.1 read 2.7% on top of 6 N where the model's own
    products (its bmm's, forward and backward) do 5.4%."""
    from torch.utils.flop_counter import FlopCounterMode

    from dplab.lessons.chargpt import attention_flops_per_token
    cfg = GPTConfig()
    model, x = CharGPT(cfg), torch.zeros(2, cfg.block, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    bmm = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    assert attention_flops_per_token(cfg) == bmm / x.numel() == 12 * cfg.layers * cfg.block * cfg.d
    step = lesson(14).steps[0]
    assert "12·L·d·T" in step.text and any("12·L·d·T" in c.claim for c in step.checks)


def test_lesson_14_gives_mfu_also_as_chowdhery_et_al_count_it():
    """14.3 credited MFU to Chowdhery et al. and divided 6 N alone; they add attention's
    12 L H Q T a token, about a fifth more at GPT-2 small's context of 1,024."""
    from dplab.lessons.l14_real_model import simulated_mfu
    facts = simulated_mfu()
    attention = 12 * facts["h100_layers"] * facts["h100_d"] * facts["h100_block"]
    share = attention / (6 * facts["h100_n"])
    assert math.isclose(facts["h100_attn_pct"], 100 * share, rel_tol=1e-12)
    assert math.isclose(facts["h100_mfu_attn"], facts["h100_mfu"] * (1 + share), rel_tol=1e-12)
    text = lesson(14).steps[2].text
    assert "{h100_mfu_attn:.2g}%" in text and "Chowdhery et al. add attention" in text


def test_lesson_14s_two_rank_utilisation_divides_by_the_core_peak_the_text_gives(monkeypatch):
    """14.3 printed DDP's 1,514 tokens/s as 20% of two cores' matmul where the 29.6 GFLOP/s core it
    gives makes it 5%: the two ranks divided by the peak they measured while sharing the cores."""
    from dplab.lessons import l14_real_model as l14
    one = [(30e9, [0.2, 0.25, 0.3], 31e9, [0.2, 0.2, 0.2])]
    two = [(7e9, [0.3, 0.35, 0.4], 30e9, [0.15, 0.15, 0.15]),
           (8e9, [0.3, 0.3, 0.3], 30e9, [0.1] * 3)]

    class World:
        def __init__(self, ranks):
            self.ranks = ranks

        def run(self, *args):
            return self.ranks

    class Lab:
        def world(self, p, backend="local"):
            return World(one if p == 1 else two)

    monkeypatch.setattr(l14, "_warm", lambda: None)
    monkeypatch.setattr(l14, "simulated_mfu", lambda: {})
    f = l14.tokens_and_mfu(Lab())
    assert math.isclose(f["mfu1"], 100 * f["tps1"] / f["ideal_tps"], rel_tol=1e-9)
    assert math.isclose(f["mfu2"], 100 * f["tps2"] / (2 * f["ideal_tps"]), rel_tol=1e-9)
    claims = [c for c in lesson(14).steps[2].checks if "one core's matmul allows" in c.claim]
    assert len(claims) == 1 and claims[0].holds(f)


def test_lesson_15_says_how_torchs_syncbatchnorm_gathers_its_statistics():
    """15.3 said torch's nn.SyncBatchNorm 'does this' after describing an all-reduce of sums; torch
    all-gathers each rank's mean, inverse std and count (batch_norm_gather_stats_with_counts)."""
    import inspect

    from torch.nn.modules._functions import SyncBatchNorm

    source = inspect.getsource(SyncBatchNorm.forward)
    assert "all_gather" in source and "batch_norm_gather_stats_with_counts" in source
    text = lesson(15).steps[2].text
    assert "`nn.SyncBatchNorm` does this" not in text
    assert "all-gathers each rank's mean, inverse standard deviation and count" in text


def test_lesson_15_prefetch_reply_of_one_says_prefetch_is_what_holds_two():
    """15.6's reply to '1' read "one is FSDP without prefetch: the next layer's gather runs while
    this one computes", as if that were FSDP without prefetch."""
    step = lesson(15).steps[5]
    said = step.predict.judge({"held_on": 2, "layers": 7}, "1").misconception
    assert "without prefetch: the next" not in said and "without prefetch; with it" in said
