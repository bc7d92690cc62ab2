"""The loss scaler on its own: torch's GradScaler rules, cross-rank agreement, the compute copy.

This is the API other trainers (ZeRO's stages) call: ``compute_copy``, ``scaler.loss_scale``,
``scaler.unscale_and_check(comm, grads, out)``, ``scaler.update(found_inf, step)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from dplab.reference.errors import ConfigError
from dplab.reference.precision import LossScaler, MixedPrecision, ScaleEvent, compute_copy
from dplab.reference.trace import Tracer

PATTERN = [False, True, False, False, False, False, True, True, False, False, False, False, False]


def ours(pattern: list[bool], **kw) -> list[tuple[float, bool]]:
    scaler = LossScaler(MixedPrecision(**kw))
    out = []
    for found_inf in pattern:
        took = scaler.update(found_inf)
        out.append((scaler.loss_scale, took))
    return out


def torch_gradscaler(pattern: list[bool], init_scale: float, growth_interval: int) -> list:
    """torch.amp.GradScaler on CPU, an inf planted in the gradient where the pattern says so."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for found_inf in pattern:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if found_inf:
            p.grad[1] = float("inf")
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), not torch.equal(before, p.detach())))
    return out


@pytest.mark.torch
@pytest.mark.parametrize("init_scale", [1024.0, 2.0**127])  # 2**128 is no float32: growth refused
def test_dynamic_rule_matches_torch_gradscaler(init_scale):
    expected = torch_gradscaler(PATTERN, init_scale, growth_interval=3)
    assert ours(PATTERN, init_scale=init_scale, growth_interval=3) == expected
    assert [took for _, took in expected] == [not f for f in PATTERN]  # skipped exactly on overflow


@pytest.mark.torch
def test_torch_has_no_static_scaler_and_a_hand_scaled_step_takes_the_inf():
    """Why a static scale stops the run here: GradScaler refuses to be static, and the static scale
    torch users write by hand, (loss * S).backward(); p.grad /= S; opt.step(), steps into inf with
    no word. Ours raises at that overflow instead, before the step (no skip: the scale is
    static)."""
    torch = pytest.importorskip("torch")
    for kw in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}):
        with pytest.raises(AssertionError):
            torch.amp.GradScaler("cpu", **kw)
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    (p.sum() * 2.0**20).backward()  # float16 gradient of 2**20 overflows
    p.grad /= 2.0**20
    torch.optim.SGD([p], lr=0.1).step()
    assert not torch.isfinite(p).any()
    # never moves
    assert ours([False, False], loss_scale=2.0**20) == [(2.0**20, True), (2.0**20, True)]
    with pytest.raises(ConfigError, match=r"step -1: the gradients overflowed float16 .* static "
                                          r"loss scale"):
        ours([True], loss_scale=2.0**20)


def test_events_and_history():
    tracer = Tracer(0, enabled=True)
    scaler = LossScaler(MixedPrecision(init_scale=8.0, growth_interval=2), tracer)
    for step, found_inf in enumerate([True, False, False, False]):
        scaler.update(found_inf, step)
    assert scaler.history == [ScaleEvent(0, "skip", 8.0, 8.0), ScaleEvent(0, "backoff", 8.0, 4.0),
                              ScaleEvent(2, "growth", 4.0, 8.0)]
    events = tracer.take()
    assert [e.kind for e in events] == ["loss_scale"] * 3
    assert [e.extra for e in events][2] == {
        "step": 2,
        "action": "growth",
        "scale": 4.0,
        "new_scale": 8.0,
    }
    state = scaler.state_dict()
    again = LossScaler(MixedPrecision(init_scale=8.0, growth_interval=2))
    again.load_state_dict(state)
    assert (again.loss_scale, again.growth_tracker) == (8.0, 1)


def job_check(comm, replicated: bool):
    """Rank 1's shard holds an inf, rank 0's does not."""
    scaler = LossScaler(MixedPrecision(init_scale=1024.0))
    grads = np.full(5, 2048.0, np.float16)
    if comm.rank == 1:
        grads[3] = np.inf
    out = np.empty(5, np.float32)
    found = scaler.unscale_and_check(comm, grads, out, replicated=replicated)
    return found, out.tolist()


def test_every_rank_agrees_on_an_overflow_only_one_rank_saw(worlds):
    results = worlds(2).run(job_check, False)
    assert [found for found, _ in results] == [True, True]  # one tiny all-reduce of the flag
    assert results[0][1] == [2.0] * 5  # unscaled into float32: 2048 / 1024
    alone = worlds(2).run(job_check, True)  # replicated=True trusts the buffer to be everyone's
    assert [found for found, _ in alone] == [False, True]


def test_unscale_in_place_and_bad_shapes():
    scaler = LossScaler(MixedPrecision(loss_scale=1000.0))
    grads = np.array([1000.0, 3000.0, -500.0], np.float16)
    comm = None  # never used: replicated=True sends nothing
    assert scaler.unscale_and_check(comm, grads, replicated=True) is False
    assert grads.tolist() == [1.0, 3.0, -0.5]  # divided, not multiplied by a rounded 1/1000
    with pytest.raises(ConfigError, match="same shape"):
        scaler.unscale_and_check(comm, grads, np.empty(4, np.float32), replicated=True)


def test_compute_copy_rounds_to_nearest_and_overflows_to_inf():
    master = np.array([1 / 3, 1 + 2.0**-12, 70000.0, -1e-8], np.float32)
    out = compute_copy(master, np.empty(4, np.float16))
    with np.errstate(over="ignore"):
        assert out.tobytes() == master.astype(np.float16).tobytes()
    assert out[1] == 1.0 and out[2] == np.inf and out[3] == 0.0
    with pytest.raises(ConfigError, match="shape"):
        compute_copy(master, np.empty(3, np.float16))
