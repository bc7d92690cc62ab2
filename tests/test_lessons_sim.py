"""Issue 31's timing on the simulated cluster: the simulated halves of lessons 3, 4, 5, 12 and 14.

    pytest -q tests/test_lessons_sim.py  # the whole steps (live halves too) run under -m lessons

Each test runs the step's simulated half alone (simulated time: the same at any load) and checks
that what its text claims follows from those numbers, and that the text reads them from the run.
"""

from __future__ import annotations

import math

import pytest

from dplab.backends.sim.timing import ddp_step_time
from dplab.lessons import lesson


def test_3_2_fit_recovers_the_cluster_files_alpha_beta_gamma():
    from dplab.lessons.l03_cost import fit_simulated
    model, truth, c = fit_simulated()
    assert c.name == "dgx-h100" and len(model.rows) == 16
    for k in ("alpha", "beta", "gamma"):
        assert math.isclose(getattr(model, k), truth[k], rel_tol=1e-9), k
    text = lesson(3).steps[1].text
    assert (
        "{sim_alpha_us:.3g}" in text and "{file_alpha_us:.3g}" in text and "On this machine" in text
    )


def test_3_2_says_so_when_the_live_fit_drops_alpha():
    """At load 37 the live fit set α and β to 0, and the text said only that β was 0."""
    from dplab.lessons.l03_cost import zero_said
    said = zero_said(["α", "β"])
    assert said.startswith("α and β came out exactly 0") and said.endswith("to γ.")
    assert zero_said([]) == "Both per-byte terms came out positive."


def test_4_2_small_buckets_hide_the_all_reduce_on_a_dgx_node():
    from dplab.lessons.l04_buckets import DGX_CAPS, _dgx_facts
    f = _dgx_facts()
    one, default, small = f["dgx_exposed"]
    assert DGX_CAPS[0] > 1000 and math.isclose(one, f["dgx_alone"], rel_tol=1e-9)
    assert one > default > small > 0 and f["dgx_saved_pct"] > 5


def test_the_sims_ddp_buckets_overlap_backward():
    """The comm thread's reductions queued behind backward on the one device resource: 25 MB
    buckets exposed 0.82 ms of a 0.83 ms all-reduce, as much as one bucket at the end."""
    from dplab.lessons.l05_scaling import sim_layers
    layers = sim_layers(16, "dgx-h100")
    compute = sum(f + b for _, f, b in layers)
    one, buckets = (ddp_step_time("dgx-h100", 8, layers, cap, "ring", 2).seconds - compute
                    for cap in (1e4, 25.0))
    assert buckets < one / 2


def test_5_3_strong_and_weak_scaling_on_64_gpus():
    from dplab.lessons.l05_scaling import SIM_PS, scaling_on_64_gpus
    f = scaling_on_64_gpus()
    assert SIM_PS[-1] == f["sim_gpus"] == 64 and f["sim_cluster"] == "dgx-h100x8"
    strong, weak = f["eff_strong"], f["eff_weak"]
    assert strong == sorted(strong, reverse=True) and weak == sorted(weak, reverse=True)
    assert f["eff_strong_8"] > 0.95 > 0.9 > f["eff_last"] and 1 < f["weak_growth"] < 2
    assert strong[-1] == weak[-1] and f["speedup_last"] == pytest.approx(64 * f["eff_last"])
    step = lesson(5).steps[2]
    assert (
        "{sim_table}" in step.text and "On this machine" in step.text and "{load:.1f}" in step.text
    )


def test_12_1_data_parallel_is_launch_bound_when_kernels_are_short():
    from dplab.lessons.l12_engines import _simulated_node
    f = _simulated_node()
    assert 1 < f["big_x"] < 1.5 and f["small_x"] > 2
    assert f["big_host_ms"] < f["big_gpu_ms"] and f["small_host_ms"] > f["small_gpu_ms"]
    assert f["small_dp_ms"] >= f["small_host_ms"]


def test_14_prices_gpt2_small_from_its_shapes():
    pytest.importorskip("torch")
    from dplab.lessons.chargpt import param_formula
    from dplab.lessons.priced import GPT2_SMALL, price_units
    units = price_units(GPT2_SMALL, 16)
    cfg = GPT2_SMALL
    assert units.n_matmul == param_formula(cfg) - (cfg.vocab + cfg.block) * cfg.d  # 6 N's N
    assert units.n_matmul == 85_079_040
    forward = sum(o.flops for _, _, f, _ in units.in_order() for o in f)
    backward = sum(o.flops for _, _, _, b in units.in_order() for o in b)
    assert backward == pytest.approx(2 * forward, rel=0.01)  # the head's input needs no gradient
    assert price_units(GPT2_SMALL, 16) is units


def test_14_3_mfu_on_h100s_follows_from_the_simulated_step():
    pytest.importorskip("torch")
    from dplab.lessons.l14_real_model import simulated_mfu
    f = simulated_mfu()
    assert f["h100_mfu"] == pytest.approx(
        100 * 6 * f["h100_n"] * f["h100_tps"] / (8 * 989.4e12), rel=1e-9)
    assert 5 < f["h100_mfu"] < 60 and f["h100_memory_pct"] > f["h100_matmul_pct"]
    assert f["h100_score_pct"] > 50 and 0 <= f["h100_ddp_pct"] < 2
    step = lesson(14).steps[2]
    assert "{h100_mfu:.2g}" in step.text and "this machine" in step.text.lower()
    assert step.predict.answer == "h100_ideal_tps"


def test_14_words_follow_the_repeats():
    from dplab.lessons.l14_real_model import two_word
    assert two_word([1.0, 1.0], [0.5, 0.9]) == "slower"
    assert two_word([1.0, 1.0], [1.5, 1.1]) == "faster"
    assert "some" in two_word([1.0, 1.0], [0.9, 1.1])


def test_14_4_splits_the_simulated_step():
    pytest.importorskip("torch")
    from dplab.lessons.l14_real_model import simulated_split
    f = simulated_split()
    assert f["sim_bwd_ms"] > f["sim_fwd_ms"] and 0 <= f["sim_exposed_ms"] < f["sim_ring_ms"]
    assert f["sim_grad_bytes"] == 2 * 85_079_040 + 2 * (30 + 1024) * 768
    text = lesson(14).steps[3].text
    assert "DDP against one process, on this machine" in text and "{ddp_word}" in text


def test_14_6_profile_counts_two_backward_matmuls_per_forward_one():
    step = lesson(14).steps[5]
    assert "torch.profiler" in step.title and step.predict.answer == "bwd_mm"
    assert "profiling" in step.teaches
    verdict = step.predict.judge({"fwd_mm": 19, "bwd_mm": 38}, "19")
    assert not verdict.correct and "two for each" in verdict.message
