"""The user's own collectives on their group, after a step of our FSDP, DDP and ZeRO over it.

    dist.init_process_group("gloo"); comm = TorchComm.from_process_group()
    fsdp = FSDP(model, comm, units=[...]); loss_fn(fsdp(x)).backward()
    dist.all_gather(out, t)                         # the user's: must not wait for anything of ours

When backward returns, nothing of ours is in flight on the group (no gather, reduction or prefetch,
no job on the comm thread): the user's all-reduce, broadcast, point-to-point and all-gather run
next, with prefetch on or off. A parameter's ``.grad`` under FSDP is this rank's piece, of another
size on each rank, as torch's FSDP with use_orig_params: a collective over it is the user's
mismatch (gloo waits for the bytes that never come). The full gradient, the same on every rank, is
``summon_full_params(with_grads=True)``'s, and equals one process's. DDP's ``.grad`` and ZeRO's
parameters after ``step()`` are replicas, and a user's all-gather of them just works.

    pytest -q tests/test_fsdp_user_collective.py
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta

import numpy as np
import pytest

from dplab.backends.torchdist.setup import available

if available():
    pytest.skip(f"torch backend unavailable: {available()}", allow_module_level=True)

import torch  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = pytest.mark.torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo once, before forks
F64 = torch.float64
VOCAB, DIM, SEQ = 16, 8, 5
WAIT_S = 30  # the gloo group's timeout: a hang fails the rank in this long, not never


class Toy(nn.Module):
    """A toy transformer block: an embedding, linears, an RMSNorm, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, dtype=F64)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM, dtype=F64))
        self.up, self.down = nn.Linear(DIM, 2 * DIM, dtype=F64), nn.Linear(2 * DIM, DIM, dtype=F64)
        self.norm = nn.RMSNorm(DIM, dtype=F64)
        self.head = nn.Linear(DIM, VOCAB, dtype=F64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


def tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7 + rank))


def loss_of(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.roll(-1, 1).reshape(-1))


def _nothing_in_flight(fsdp) -> bool:
    pool = fsdp._gathers.runner._pool
    return (not fsdp._gathers._jobs and not fsdp._gathers._inflight
            and (pool is None or pool._work_queue.empty()))


def _attribute(model: nn.Module, name: str) -> torch.Tensor:
    """``model.<name>`` as the module's code reads it (inside summon_full_params: the full one)."""
    prefix, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(prefix), leaf)


def _users_collectives(rank: int, world_size: int, t: torch.Tensor) -> dict:
    """What a user runs on the default group right after a step of ours."""
    import torch.distributed as dist

    out = {}
    s = torch.tensor([float(rank + 1)], dtype=F64)
    dist.all_reduce(s)
    out["all_reduce"] = float(s)
    b = torch.tensor([float(rank)], dtype=F64)
    dist.broadcast(b, src=1)
    out["broadcast"] = float(b)
    msg = torch.tensor([float(rank)], dtype=F64)
    if rank == 0:
        dist.send(msg, dst=1, tag=0)
    else:
        dist.recv(msg, src=0, tag=0)
    out["p2p"] = float(msg)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t.contiguous())
    out["all_gather"] = [g.clone() for g in gathered]
    return out


def _user_script(rank: int, world_size: int, store: str) -> dict:
    import torch.distributed as dist

    from dplab.backends.nn.ddp import DDP
    from dplab.backends.nn.fsdp import FSDP
    from dplab.backends.nn.zero import ZeroRedundancyOptimizer
    from dplab.backends.torchdist.comm import TorchComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=WAIT_S))
    comm = TorchComm.from_process_group(timeout=WAIT_S)
    out: dict = {}
    x = tokens(rank)
    for prefetch in (False, True):
        model = Toy()
        kw = {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"} if prefetch else {}
        fsdp = FSDP(model, comm, units=[model.emb, model.up, model.down, model.head], **kw)
        for _ in range(2):  # the second forward is the first that prefetches
            fsdp.zero_grad()
            loss_of(fsdp(x), x).backward()
        idle = _nothing_in_flight(fsdp)
        pieces = {name: p.grad.numel() for name, p in fsdp.named_parameters()}
        with fsdp.summon_full_params(with_grads=True):
            full = {name: _attribute(model, name).grad.clone()
                    for name, _ in model.named_parameters()}
            users = _users_collectives(rank, world_size, model.norm.weight.grad)
        out[prefetch] = {"idle": idle, "pieces": pieces, "full": full, "users": users}
    model = Toy()
    ddp = DDP(model, comm)
    loss_of(ddp(x), x).backward()
    out["ddp"] = _users_collectives(rank, world_size, model.norm.weight.grad)
    ddp.close()
    model = Toy()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm, lr=0.1)
    loss_of(model(x), x).backward()
    opt.step()
    out["zero"] = _users_collectives(rank, world_size, model.norm.weight.detach())
    comm.close()
    dist.destroy_process_group()
    return out


def _plain(value):
    """Tensors as numpy arrays: a tensor sent through a pipe is shared memory that leaves with
    its sender."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _rank(rank: int, world_size: int, store: str, conn) -> None:
    try:
        conn.send(("ok", _plain(_user_script(rank, world_size, store))))
    except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
        conn.send(("error", traceback.format_exc()))


def _run_forked(world_size: int, store: str, timeout: float) -> list:
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, world_size, store, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        results = []
        for rank, conn in enumerate(pipes):
            assert conn.poll(timeout), f"rank {rank} sent nothing in {timeout}s: a collective hung"
            status, value = conn.recv()
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results.append(value)
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_users_collectives_after_a_step_of_fsdp_ddp_and_zero(tmp_path):
    p = 2
    results = _run_forked(p, str(tmp_path / "store"), timeout=4 * WAIT_S)
    model = Toy()  # one process, the batch of both ranks: FSDP averages the ranks' mean losses
    for rank in range(p):
        x = tokens(rank)
        (loss_of(model(x), x) / p).backward()
    want = {name: q.grad.numpy() for name, q in model.named_parameters()}
    for prefetch in (False, True):
        for rank, r in enumerate(results):
            got = r[prefetch]
            assert got["idle"], f"rank {rank} (prefetch={prefetch}): a job of ours in flight"
            users = got["users"]
            assert users["all_reduce"] == 3.0 and users["broadcast"] == 1.0 and users["p2p"] == 0.0
            for g in users["all_gather"]:  # every rank's full gradient: one process's
                np.testing.assert_allclose(g, want["norm.weight"], rtol=1e-10, atol=1e-14)
            for name, g in got["full"].items():
                np.testing.assert_allclose(g, want[name], rtol=1e-10, atol=1e-14)
        # the pieces: sizes that differ between the ranks, so the full gradient is summoned
        sizes = [r[prefetch]["pieces"] for r in results]
        assert any(sizes[0][n] != sizes[1][n] for n in sizes[0]), sizes
        assert all(sizes[0][n] + sizes[1][n] == want[n].size for n in sizes[0])
    for kind in ("ddp", "zero"):
        for r in results:
            users = r[kind]
            assert users["all_reduce"] == 3.0 and users["broadcast"] == 1.0 and users["p2p"] == 0.0
            first, second = users["all_gather"]
            np.testing.assert_array_equal(first, second)  # replicas: every rank holds the same
