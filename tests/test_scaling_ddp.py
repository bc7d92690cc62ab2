"""``dplab scaling --ddp``: one process on the 1/p batch, p independent processes, our DDP, torch's
DDP."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from dplab.backends.cli.scaling_ddp import DDP_COLUMNS, DdpBench, ddp_rows, run_ddp  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.torch

TINY = DdpBench(in_dim=8, hidden=(16,), out_dim=4, global_batch=8, steps=2, warmup=1)


def test_the_default_model_is_the_issues_10_5_m_parameter_mlp():
    assert DdpBench().params() == 10_492_416  # 512 -> 2048 -> 2048 -> 2048 -> 512, with biases
    assert TINY.params() == 8 * 16 + 16 + 16 * 4 + 4


def test_rows_are_medians_and_ratios_within_the_run():
    times = {("single", "local"): [(0.010, 0.009), (0.012, 0.010), (0.011, 0.011)],
             ("dplab", "local"): [(0.013, 0.012), (0.014, 0.013), (0.050, 0.012)],
             ("torch_ddp", "torch"): [(0.022, 0.030)]}
    rows = {r["impl"]: r for r in ddp_rows(times, DdpBench(), 2, load=1.5)}
    assert rows["single"]["ratio_vs_single"] == 1.0 and rows["single"]["global_batch"] == 32
    assert rows["single"]["world_size"] == 1 and rows["dplab"]["world_size"] == 2
    # the median: one busy rep does not count
    assert rows["dplab"]["step_ms"] == pytest.approx(14.0)
    assert rows["dplab"]["ratio_vs_single"] == pytest.approx(14 / 11)
    assert rows["dplab"]["cpu_ratio_vs_single"] == pytest.approx(12 / 10)
    assert rows["torch_ddp"]["ratio_vs_single"] == pytest.approx(2.0)
    assert rows["torch_ddp"]["load_1min"] == 1.5


def test_a_tiny_run_puts_torch_ddp_beside_ours_with_every_field():
    # one backend keeps it short: ~5 s, mostly start-up
    rows = run_ddp(TINY, ["torch"], [2], reps=1)
    assert [(r["impl"], r["backend"]) for r in rows] == [("single", "torch"), ("independent", "-"),
                                                         ("dplab", "torch"), ("torch_ddp", "torch")]
    for r in rows:
        assert (
            set(DDP_COLUMNS) <= set(r) and r["step_ms"] > 0 and r["cpu_ms"] > 0 and r["reps"] == 1
        )
    assert (
        rows[0]["ratio_vs_single"] == 1.0
        and rows[0]["global_batch"] == 4
        and rows[0]["world_size"] == 1
    )
    assert all(r["world_size"] == 2 and r["global_batch"] == 8 for r in rows[1:])


def test_a_global_batch_smaller_than_the_world_is_refused():
    with pytest.raises(ConfigError, match="global batch 1 < world size 2"):
        run_ddp(DdpBench(global_batch=1), ["local"], [2], reps=1)


def _hook_ops(comm) -> tuple[list[str], list[str], bool]:
    """The tensor operations of two backwards of DDP over one Linear: gradients fresh, then kept."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dplab.backends.nn.ddp import DDP

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 3), comm)
    x = torch.full((5, 4), float(comm.rank + 1))
    ops = []
    for set_to_none in (True, False):
        model.zero_grad(set_to_none=set_to_none)
        loss = model(x).sum()
        with Log() as log:
            loss.backward()
        ops.append([op for op in log.ops if op.startswith(("aten.copy", "aten.div", "aten.mul"))])
    # d sum / dW = the sum of x over the batch, averaged
    expected = torch.full((3, 4), (1 + 2) * 5 / 2)
    ok = torch.equal(model.module.weight.grad, expected)
    model.close()
    return ops[0], ops[1], ok


def test_the_hook_averages_each_gradient_in_one_pass(worlds):
    """A fresh gradient (grad was None) is divided into its slot by one op, not copied and then
    divided (two passes over 42 MB for the 10.5 M-parameter MLP, ~2 ms of a ~70 ms step)."""
    fresh, kept, ok = worlds(2).run(_hook_ops)[0]  # the session's world: its ranks have torch warm
    assert fresh == ["aten.div.out", "aten.div.out"]  # weight and bias, one pass each
    assert kept == ["aten.div.out", "aten.div.out"]  # autograd added into the slot; scaled in place
    assert ok
