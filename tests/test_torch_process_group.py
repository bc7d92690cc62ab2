"""A dplab communicator over a process group the user started, as torch scripts do.

    dist.init_process_group("gloo", ...)       # the user's
    comm = TorchComm.from_process_group()      # ours, over it
    ...                                        # our ring all-reduce, DDP
    comm.close()                               # the user's group is still there

Ranks are forked here and rendezvous through a FileStore in the test's tmp_path; each sends
its findings back through a pipe, and every wait has a timeout.
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


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 2, dtype=F64))


def batch(rank: int) -> tuple:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(4, 3, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64)


def _user_script(rank: int, world_size: int, store: str) -> dict:
    """What a rank of a user's torch script does, with dplab in the middle."""
    import torch.distributed as dist

    from dplab.backends.nn.ddp import DDP
    from dplab.backends.torchdist.comm import TorchComm
    from dplab.reference.collectives import allreduce
    from dplab.reference.errors import ConfigError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    sub = dist.new_group([1, 2])  # every rank creates it, as torch requires
    out: dict = {}
    comm = TorchComm.from_process_group(timeout=30.0)
    out["rank"], out["world_size"], out["owns"] = comm.rank, comm.world_size, comm.owns_group
    buf = np.arange(7, dtype=np.float64) * (rank + 1)
    allreduce(comm, buf, "ring")
    out["ring"] = buf.copy()
    ddp = DDP(make_model(10 + rank), comm, bucket_cap_mb=1e-9)
    x, y = batch(rank)
    ((ddp(x) - y) ** 2).mean().backward()
    out["grads"] = [p.grad.numpy().copy() for p in ddp.parameters()]
    ddp.close()
    comm.close()
    again = TorchComm(rank, world_size, 30.0)  # the constructor notices the group, too
    out["again_owns"] = again.owns_group
    again.barrier()
    again.close()
    try:
        TorchComm((rank + 1) % world_size, world_size, 30.0)
        out["wrong_rank"] = "no error"
    except ConfigError as e:
        out["wrong_rank"] = str(e)
    if rank in (1, 2):  # a subgroup: ranks are the group's own
        part = TorchComm.from_process_group(sub, timeout=30.0)
        out["sub"] = (part.rank, part.world_size)
        small = np.full(5, float(rank))
        allreduce(part, small, "tree")
        native = np.full(3, float(rank))
        part.native_allreduce(native)
        out["sub_sums"] = (small.copy(), native.copy())
        part.close()
    out["initialised_after_close"] = dist.is_initialized()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the user's group still works
    out["user_all_reduce"] = float(t)
    dist.destroy_process_group()
    return out


def _rank(rank: int, world_size: int, store: str, conn) -> None:
    try:
        conn.send(("ok", _user_script(rank, world_size, store)))
    except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
        conn.send(("error", traceback.format_exc()))


def run_forked(fn, world_size: int, *args, timeout: float = 60.0) -> list:
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=fn, args=(rank, world_size, *args, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        results = []
        for rank, conn in enumerate(pipes):
            assert conn.poll(timeout), f"rank {rank} sent nothing in {timeout}s"
            status, value = conn.recv()
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results.append(value)
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_our_collectives_and_ddp_over_the_users_group_which_close_leaves_alone(tmp_path):
    p = 3
    results = run_forked(_rank, p, str(tmp_path / "store"))
    expected_ring = np.arange(7, dtype=np.float64) * sum(range(1, p + 1))
    model = make_model(10)  # rank 0's weights, which DDP broadcast
    for q in model.parameters():
        q.grad = None
    grads = []
    for rank in range(p):
        model.zero_grad()
        x, y = batch(rank)
        ((model(x) - y) ** 2).mean().backward()
        grads.append([q.grad.numpy().copy() for q in model.parameters()])
    average = [sum(g[i] for g in grads) / p for i in range(len(grads[0]))]
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["owns"], r["again_owns"]) == (rank, p, False, False)
        np.testing.assert_array_equal(r["ring"], expected_ring)
        for mine, theirs in zip(r["grads"], average):
            np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=1e-15)
        assert "from_process_group" in r["wrong_rank"]
        assert r["initialised_after_close"] is True
        assert r["user_all_reduce"] == sum(range(1, p + 1))
        if rank in (1, 2):
            assert r["sub"] == (rank - 1, 2)
            np.testing.assert_array_equal(r["sub_sums"][0], np.full(5, 3.0))
            np.testing.assert_array_equal(r["sub_sums"][1], np.full(3, 3.0))


def test_from_process_group_without_a_group_says_what_to_do():
    from dplab.backends.torchdist.comm import TorchComm
    from dplab.reference.errors import ConfigError

    with pytest.raises(ConfigError, match="init_process_group"):
        TorchComm.from_process_group()
