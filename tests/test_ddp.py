"""The torch DDP wrapper == single-process training on the global batch, after every step.

The single-process reference trains on the whole global batch with the mean loss; each
rank of ``DDP`` trains on its equal shard. In float64 the parameters must agree within
relative 1e-10 after every step, on every rank, for every world size, algorithm and bucket
size, with frozen parameters, tied weights and ``no_sync`` accumulation. The reference runs
in the test process; the ranks return their parameters after each step.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from tiers import engines

torch = pytest.importorskip("torch")
from strategies import one_at_a_time, seed_torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.schedule import chunk_bounds  # noqa: E402

pytestmark = pytest.mark.torch
# torch.optim pulls in torch._dynamo on first use (about a second): do it once here, before
# the worlds fork, instead of once in every rank. (MPI ranks are fresh interpreters: they pay.)
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

ALGORITHMS = ["naive", "ring", "tree", "direct", "native"]
BACKENDS = ["local", pytest.param("mpi", marks=pytest.mark.mpi), "torch"]
HUGE, SEVERAL, TINY = 1e3, 200 / 2**20, 1e-9  # MiB: one bucket / two buckets / one per parameter
B, STEPS, F64 = 24, 3, torch.float64  # B divides by every world size 1..4 (DDP's assumption)
SEED = 100  # rank r builds its model with SEED + r: the broadcast must make it rank 0's


# -- models and data (module level: MPI ranks unpickle what they run) ------------------------

class Frozen(nn.Module):
    """A frozen weight (its bias trains) and a buffer: both must come from rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(5, 8, dtype=F64), nn.Linear(8, 8, dtype=F64), \
            nn.Linear(8, 3, dtype=F64)
        self.mid.weight.requires_grad_(False)
        self.register_buffer("scale", torch.rand(8, dtype=F64) + 0.5)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))) * self.scale)


class Tied(nn.Module):
    """A tiny language model whose output projection is its embedding (used twice per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(11, 6, dtype=F64), nn.Linear(6, 6, dtype=F64)
        self.head = nn.Linear(6, 11, bias=False, dtype=F64)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class Deep(nn.Module):
    """Big enough that backward outlasts the start of the first bucket's all-reduce."""

    def __init__(self, width: int = 512, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, dtype=F64) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(3, 2, dtype=F64), nn.Linear(3, 2, dtype=F64)

    def forward(self, x):
        return self.used(x)


MODELS = {"frozen": Frozen, "tied": Tied, "deep": Deep, "unused": Unused}


@one_at_a_time
def make_model(kind: str, seed: int) -> nn.Module:
    seed_torch(seed)
    return MODELS[kind]()


def batch(kind: str, step: int, n: int = B) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        return torch.randint(0, 11, (n,), generator=g), torch.randint(0, 11, (n,), generator=g)
    dim = {"frozen": (5, 3), "deep": (512, 512), "unused": (3, 2)}[kind]
    return torch.randn(n, dim[0], generator=g, dtype=F64), torch.randn(
        n, dim[1], generator=g, dtype=F64
    )


def loss_sum(kind: str, out, y):
    """Sum of per-sample losses: divide by the (shard) batch size to get the mean."""
    return F.cross_entropy(out, y, reduction="sum") if kind == "tied" else ((out - y) ** 2).sum()


def snapshot(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


@cache
def reference(kind: str, steps: int = STEPS) -> tuple:
    """Single process, whole global batch, mean loss: parameters after each step."""
    model = make_model(kind, seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = [snapshot(model)]
    for step in range(steps):
        x, y = batch(kind, step)
        opt.zero_grad()
        (loss_sum(kind, model(x), y) / B).backward()
        opt.step()
        snaps.append(snapshot(model))
    return tuple(snaps)


def rel(a, b) -> float:
    """max|a - b| / max(1, max|b|): relative for large values, absolute near zero."""
    return float(np.max(np.abs(a - b), initial=0) / max(1.0, float(np.max(np.abs(b), initial=0))))


# -- rank functions --------------------------------------------------------------------------

def _train_ddp(
    comm, kind: str, cap: float, algorithm: str, accum: int = 1, steps: int = STEPS
) -> dict:
    """Train DDP on this rank's shard (``accum`` micro-batches, all but the last in no_sync)."""
    from dplab.backends.nn.ddp import DDP

    torch.set_num_threads(1)
    model = make_model(kind, seed=SEED + comm.rank)
    staged = getattr(comm, "bytes_staged", 0)
    ddp = DDP(model, comm, bucket_cap_mb=cap, algorithm=algorithm)
    shared = model.emb.weight if kind == "tied" else None
    hook_calls: list[int] = []
    if shared is not None:
        shared.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    per_rank = B // comm.world_size
    snaps, calls, no_sync_buckets = [snapshot(model)], [], []
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        for step in range(steps):
            x, y = batch(kind, step)
            lo = comm.rank * per_rank
            opt.zero_grad(set_to_none=step % 2 == 0)  # both: grads dropped, and grads kept as views
            for j, (a, b) in enumerate(chunk_bounds(per_rank, accum)):
                xs, ys = x[lo + a:lo + b], y[lo + a:lo + b]
                if j < accum - 1:
                    comm.tracer.take()
                    with ddp.no_sync():
                        (loss_sum(kind, ddp(xs), ys) / per_rank).backward()
                    no_sync_buckets.append(sum(e.kind == "bucket" for e in comm.tracer.take()))
                else:
                    (loss_sum(kind, ddp(xs), ys) / per_rank).backward()
            calls.append(len(hook_calls))
            hook_calls.clear()
            opt.step()
            snaps.append(snapshot(model))
    finally:
        comm.tracer.enabled = False
        comm.tracer.take()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return {"snaps": snaps, "buckets": len(ddp.reducer.buckets), "trainable": len(ddp.grad_slots),
            "hook_calls": calls, "no_sync_buckets": no_sync_buckets,
            "frozen_grads": [model.get_parameter(n).grad is None for n in frozen],
            "buffers": [b.numpy().copy() for b in model.buffers()],
            "staged": getattr(comm, "bytes_staged", 0) - staged}


def _surface(comm) -> dict:
    from dplab.backends.nn.ddp import DDP

    model = make_model("frozen", seed=SEED + comm.rank)
    ddp = DDP(model, comm)
    return {"module_is_model": ddp.module is model,
            "own": [n for n, _ in ddp.named_parameters(recurse=False)],
            "names": [n for n, _ in ddp.named_parameters()],
            "inner": [n for n, _ in model.named_parameters()],
            "same_objects": all(a is b for a, b in zip(ddp.parameters(), model.parameters())),
            "state": {k: v.numpy().copy() for k, v in ddp.state_dict().items()}}


def _overlap(comm, steps: int = 2) -> list[tuple[int, int, int, int]]:
    """Per step: (first bucket start, last bucket start, backward end, buckets), on one clock."""
    from dplab.backends.nn.ddp import DDP

    torch.set_num_threads(1)
    ddp = DDP(make_model("deep", seed=0), comm, bucket_cap_mb=2.0)  # one 2 MiB layer per bucket
    x, y = batch("deep", 0, 128)
    tr = comm.tracer
    out = []
    tr.take()
    tr.enabled = True
    try:
        for _ in range(steps):
            with tr.span("backward"):
                ((ddp(x) - y) ** 2).mean().backward()
            events = tr.take()
            starts = [e.t_start_ns for e in events if e.kind == "bucket" and e.thread == "comm"]
            end = next(e.t_end_ns for e in events if e.kind == "backward")
            out.append((min(starts), max(starts), end, len(starts)))
    finally:
        tr.enabled = False
    return out


def _unused_then_normal(comm) -> tuple[str, bool, np.ndarray]:
    """An unused parameter: a ConfigError naming it; then the world still reduces normally."""
    from dplab.backends.nn.ddp import DDP

    model = make_model("unused", seed=0)
    ddp = DDP(model, comm, bucket_cap_mb=TINY)
    x, y = batch("unused", comm.rank, 4)
    try:
        ((ddp(x) - y) ** 2).sum().backward()
        message = "no error"
    except ConfigError as e:
        message = str(e)
    ddp.close()  # its hooks go with it
    model.zero_grad()
    model.spare.weight.requires_grad_(False)
    model.spare.bias.requires_grad_(False)
    ddp = DDP(model, comm, bucket_cap_mb=TINY)
    ((ddp(x) - y) ** 2).sum().backward()
    grad = model.used.weight.grad.numpy().copy()
    ddp.wait()  # already done by backward's callback: a no-op
    ddp.finish_gradient_synchronization()
    return message, np.array_equal(grad, model.used.weight.grad.numpy()), grad


def _bad_config(comm, what: str) -> str:
    from dplab.backends.nn.ddp import DDP

    try:
        if what == "algorithm":
            DDP(make_model("frozen", 0), comm, algorithm="carrier-pigeon")
        else:
            DDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, dtype=F64)), comm)
    except ConfigError as e:
        return str(e)
    return "no error"


# -- tests -----------------------------------------------------------------------------------

def check_against_reference(kind: str, results: list[dict], label: str) -> None:
    ref = reference(kind)
    for rank, r in enumerate(results):
        assert len(r["snaps"]) == len(ref)
        for step, (mine, theirs) in enumerate(zip(r["snaps"], ref)):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                assert rel(a, b) <= 1e-10, (
                    f"{label} rank {rank} step {step} param {i}: {rel(a, b):.3g}"
                )
            assert all(np.array_equal(a, b) for a, b in zip(mine, results[0]["snaps"][step])), \
                f"{label}: rank {rank} differs from rank 0 at step {step}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_ddp_equals_single_process_after_every_step(worlds, backend, p, algorithm):
    world = worlds(p, backend)
    for kind in ("frozen", "tied"):
        init = make_model(kind, seed=SEED)
        for cap in (HUGE, SEVERAL, TINY):
            label = f"{kind} cap={cap:g}"
            results = world.run(_train_ddp, kind, cap, algorithm)
            check_against_reference(kind, results, label)
            for r in results:
                expected = {HUGE: 1, SEVERAL: 2, TINY: r["trainable"]}[cap]
                assert r["buckets"] == expected, label
                assert r["staged"] == 0, f"{label}: the flat gradient was not in shared memory"
                assert all(
                    np.array_equal(a, b)
                    for a, b in zip(r["buffers"], map(torch.Tensor.numpy, init.buffers()))
                )
                if kind == "frozen":  # mid.weight: bitwise rank 0's initial value, never a grad
                    assert all(
                        np.array_equal(s[2], init.mid.weight.detach().numpy()) for s in r["snaps"]
                    )
                    assert r["frozen_grads"] == [True]
                else:  # the tied weight is accumulated from both uses, then its hook fires once
                    assert r["hook_calls"] == [1] * STEPS


@pytest.mark.parametrize("accum", [2, 3])
# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
def test_no_sync_accumulation_equals_the_big_batch_step(worlds, backend, p, accum):
    for kind in ("frozen", "tied"):
        results = worlds(p, backend).run(_train_ddp, kind, SEVERAL, "ring", accum)
        check_against_reference(kind, results, f"{kind} accum={accum}")
        for r in results:
            assert r["no_sync_buckets"] == [0] * (STEPS * (accum - 1)), (
                "no_sync launched a reduction"
            )


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([1, 3]), indirect=["backend"])
def test_broadcast_from_rank_0_and_the_module_surface(worlds, backend, p):
    rank0 = make_model("frozen", seed=SEED)
    for r in worlds(p, backend).run(_surface):
        assert r["module_is_model"] and r["own"] == [] and r["same_objects"]
        assert r["names"] == [f"module.{n}" for n in r["inner"]]
        assert r["inner"] == [n for n, _ in rank0.named_parameters()]
        for name, value in rank0.state_dict().items():
            assert np.array_equal(r["state"][f"module.{name}"], value.numpy()), name


def test_a_bucket_reduction_starts_before_backward_ends(worlds, backend):
    for rank, steps in enumerate(worlds(2, backend).run(_overlap)):
        for first, last, end, count in steps:
            assert count == 6
            assert first < end, f"rank {rank}: the first bucket started after backward ended"
            assert last <= end  # the last bucket is complete only with the last gradient


def test_unused_parameter_is_named_and_the_world_stays_usable(worlds, backend):
    results = worlds(2, backend).run(_unused_then_normal)
    total = sum(_local_used_grad(rank) for rank in range(2)) / 2
    for message, wait_was_noop, grad in results:
        assert "module.spare.weight" not in message  # names are the module's own
        assert "spare.weight" in message and "spare.bias" in message and "used." not in message
        assert wait_was_noop
        np.testing.assert_allclose(grad, total, rtol=1e-12)


def _local_used_grad(rank: int) -> np.ndarray:
    model = make_model("unused", seed=0)
    x, y = batch("unused", rank, 4)
    ((model.used(x) - y) ** 2).sum().backward()
    return model.used.weight.grad.numpy()


@pytest.mark.parametrize(
    "what, needle", [("algorithm", "unknown algorithm"), ("dtypes", "one dtype")]
)
def test_bad_configurations_are_config_errors(worlds, what, needle):
    assert needle in worlds(1).run(_bad_config, what)[0]
