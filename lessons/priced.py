"""Lesson 14's GPT at a real size, priced on a simulated cluster from its shapes alone.

    from dplab.lessons.priced import GPT2_SMALL, price_units, ddp_layers
    from dplab.backends.sim.timing import ddp_step_time
    units = price_units(GPT2_SMALL, rows=16)  # per unit: parameters, forward, backward
    step = ddp_step_time("dgx-h100", 8, ddp_layers(units, "dgx-h100"), itemsize=2,
                         optimizer_s=units.optimizer_s("dgx-h100")).seconds

The model is built on torch's meta device: tensors with shapes and dtypes and no data, so the
forward and backward of 85 M parameters at 16 × 1,024 tokens take milliseconds on a laptop. The sim
backend's own ``TorchClock`` hands every aten operation's FLOPs (torch's registry) and bytes to a
recorder, and each operation is priced as the sim prices a rank's operation on its device
(``SimWorld.compute_seconds``: the roofline, and at least the device's time per operation). The
blocks are alike, so one is priced and counted ``layers`` times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dplab.backends.sim.setup import SimWorld, resolve_cluster
from dplab.lessons.chargpt import GPTConfig

__all__ = ["GPT2_SMALL", "Op", "Units", "price_units", "ddp_layers", "seconds", "op_split"]

# GPT-2 small's depth, width, context
GPT2_SMALL = GPTConfig(block=1024, layers=12, heads=12, d=768)


@dataclass(frozen=True)
class Op:
    """One aten operation: its FLOPs (0 when it does no matmul-like work), bytes read and
    written."""

    flops: float
    nbytes: float
    dtype: str


@dataclass(frozen=True)
class Units:
    """A training step of ``cfg`` on ``rows`` windows, as DDP sees it: the units in forward order
    (``(name, parameters, forward ops, backward ops)``; the blocks' entry stands for each of
    ``cfg.layers``), and the optimizer's operations."""

    cfg: GPTConfig
    rows: int
    dtype: str
    units: tuple[tuple[str, int, tuple[Op, ...], tuple[Op, ...]], ...]
    optimizer: tuple[Op, ...]
    n_matmul: int                      # N of 6 N: the parameters in matmuls

    def in_order(self) -> list[tuple[str, int, tuple[Op, ...], tuple[Op, ...]]]:
        """Every unit in forward order, the block repeated ``cfg.layers`` times."""
        embed, block, head = self.units
        return [embed, *[block] * self.cfg.layers, head]

    def ops(self) -> list[Op]:
        """Every operation of one step: forward, backward, optimizer."""
        units = self.in_order()
        return [o for _, _, f, _ in units for o in f] + [
            o for _, _, _, b in units for o in b] + list(self.optimizer)

    def optimizer_s(self, cluster: str) -> float:
        return seconds(self.optimizer, cluster)


class _Recorder:
    """What ``TorchClock`` hands a rank's communicator, kept instead of spent."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def compute(self, ops: list[tuple[float, float]], dtype: str) -> None:
        self.ops += [Op(f, n, dtype) for f, n in ops]


def _recorded(fn) -> tuple[Op, ...]:
    from dplab.backends.sim.compute import TorchClock

    rec = _Recorder()
    with TorchClock(rec):
        fn()
    return tuple(rec.ops)


@lru_cache(maxsize=4)
def price_units(cfg: GPTConfig = GPT2_SMALL, rows: int = 16, dtype: str = "bfloat16") -> Units:
    """The operations of one training step of a ``CharGPT(cfg)`` on ``rows`` windows per rank, in
    ``dtype`` (weights, activations and gradients; AdamW's moments too), from a run on meta
    tensors."""
    import torch
    from torch import nn

    from dplab.lessons.chargpt import Block

    meta, kind = torch.device("meta"), getattr(torch, dtype)
    old = torch.get_default_dtype()
    torch.set_default_dtype(kind)
    try:
        # CharGPT's parts, made on the CPU (one block: 7 M numbers) and moved to meta, where the
        # initialisers and the causal mask's tril would import torch's compiler (seconds)
        tok, pos = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.block, cfg.d)
        block, ln = Block(cfg), nn.LayerNorm(cfg.d)
        head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        tok, pos, block, ln, head = (m.to(meta) for m in (tok, pos, block, ln, head))
    finally:
        torch.set_default_dtype(old)
    idx = torch.zeros(rows, cfg.block, dtype=torch.int64, device=meta)

    def unit(name, modules, forward):
        out = []
        f = _recorded(lambda: out.append(forward()))
        b = _recorded(lambda: out[0].backward(torch.ones_like(out[0])))
        return name, sum(p.numel() for m in modules for p in m.parameters()), f, b

    def activations():
        return torch.empty(rows, cfg.block, cfg.d, dtype=kind, device=meta, requires_grad=True)

    h, x = activations(), activations()
    embed = unit("embeddings", (tok, pos),
                 lambda: tok(idx) + pos(torch.arange(cfg.block, device=meta)))
    blocks = unit("block", (block,), lambda: block(h))
    loss = lambda: nn.functional.cross_entropy(  # noqa: E731
        head(ln(x)).reshape(-1, cfg.vocab), idx.reshape(-1))
    last = unit("head", (ln, head), loss)
    n_all = embed[1] + cfg.layers * blocks[1] + last[1]
    # AdamW(fused=True), torch's fastest on a GPU: one pass that reads each weight, its gradient
    # and two moments and writes back three, memory-bound (running torch's own optimizer on meta
    # tensors would import torch's compiler, seconds, for the same count)
    optimizer = (Op(0.0, 7 * n_all * kind.itemsize, dtype),)
    n_matmul = cfg.layers * blocks[1] + last[1]  # all but the embeddings (chargpt.matmul_params)
    return Units(cfg, rows, dtype, (embed, blocks, last), optimizer, n_matmul)


def seconds(ops: tuple[Op, ...] | list[Op], cluster: str) -> float:
    """The time ``ops`` take one after another on one device of ``cluster``, priced as a sim rank's
    operations are."""
    world = _one_device(cluster)
    return sum(world.compute_seconds(0, o.flops, o.nbytes, o.dtype) for o in ops)


def op_split(ops: list[Op], cluster: str) -> dict[str, float]:
    """Seconds of ``ops`` by what bounds each: ``matmul`` (its FLOPs at the device's rate),
    ``memory`` (its bytes at the memory bandwidth) and ``launch`` (the device's least time per
    operation, longer than either)."""
    world = _one_device(cluster)
    d = world.device_of[0]
    out = {"matmul": 0.0, "memory": 0.0, "launch": 0.0}
    for o in ops:
        t = world.compute_seconds(0, o.flops, o.nbytes, o.dtype)
        if t == o.flops / d.rate(o.dtype):
            out["matmul"] += t
        elif t == o.nbytes / d.memory_bytes_s:
            out["memory"] += t
        else:
            out["launch"] += t
    return out


def ddp_layers(units: Units, cluster: str) -> list[tuple[int, float, float]]:
    """``ddp_step_time``'s layers: (parameters, forward seconds, backward seconds), forward
    order."""
    return [(n, seconds(f, cluster), seconds(b, cluster)) for _, n, f, b in units.in_order()]


@lru_cache(maxsize=8)
def _one_device(cluster: str) -> SimWorld:
    return SimWorld(resolve_cluster(cluster), 1, 60.0, ranks=False)
