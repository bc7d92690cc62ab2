"""A real model for lesson 14: a character-level GPT, and the text it learns, made here.

    from dplab.lessons.chargpt import GPTConfig, CharGPT, text, encode, batch
    model = CharGPT(GPTConfig(vocab=len(VOCAB)))      # ~346,000 parameters
    x, y = batch(encode(text()), rows=8, block=32, step=0)

The text is generated, not downloaded: a small grammar of sentences drawn by a seeded random
generator, so every machine gets the same bytes and nothing needs a licence or a network. The
model is minGPT's shape, written out: token and position embeddings, ``layers`` blocks of
causal self-attention and an MLP (each behind a LayerNorm, added back to the residual), a final
LayerNorm and a linear head. No dropout, so that a run is a pure function of its seed.

FLOPs: a training token costs about 6 N (forward 2 N, backward 4 N), N the parameters that take
part in a matmul (``matmul_params``: everything but the embeddings, which are lookups). Attention
adds 6 · layers · block · d more per token (QK^T and the weighted sum), a few percent here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VOCAB", "GPTConfig", "CharGPT", "text", "encode", "batch", "param_formula",
           "matmul_params", "attention_flops_per_token"]

VOCAB = "\n .,abcdefghijklmnopqrstuvwxyz"  # every character the text uses (30)

_WORDS = {
    "noun": "ring rank tree bucket gradient shard worker model batch token replica server".split(),
    "verb": "sends reduces gathers holds waits for sums copies splits shares trains".split(),
    "adj": "slow fast small large first last idle busy equal stale".split(),
}


@lru_cache(maxsize=4)
def text(chars: int = 20_000, seed: int = 0) -> str:
    """``chars`` characters of generated sentences ("the idle rank sends a shard."), the same on
    every machine: a seeded ``random.Random``, not the global one."""
    rng, out, n = random.Random(seed), [], 0
    while n < chars:
        words = [
            "the",
            rng.choice(_WORDS["adj"]),
            rng.choice(_WORDS["noun"]),
            rng.choice(_WORDS["verb"]),
            rng.choice(("a", "the", "every")),
            rng.choice(_WORDS["noun"]),
        ]
        if rng.random() < 0.3:
            words += ["and", rng.choice(_WORDS["verb"]), "it"]
        sentence = " ".join(words) + ("." if rng.random() < 0.8 else ",")
        sentence += "\n" if rng.random() < 0.2 else " "
        out.append(sentence)
        n += len(sentence)
    return "".join(out)[:chars]


def encode(s: str) -> torch.Tensor:
    """Characters -> int64 indices into ``VOCAB``."""
    index = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([index[c] for c in s], dtype=torch.int64)


def batch(
    data: torch.Tensor, rows: int, block: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step``: ``rows`` windows of ``block`` characters and their next
    characters.

    Drawn from a generator seeded by (seed, step), so every rank draws the same global batch and
    takes its own rows of it, as the reference trainer shards a batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - block - 1, (rows,), generator=g)
    x = torch.stack([data[s:s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + block + 1] for s in starts.tolist()])
    return x, y


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = len(VOCAB)
    block: int = 32        # context length, characters
    layers: int = 3
    heads: int = 4
    d: int = 96            # the residual stream's width


class Attention(nn.Module):
    """Causal self-attention: every position attends to itself and the positions before it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.block, cfg.block, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, heads, t, d/heads): each head attends on its own slice of the width
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    """A transformer block: attention, then an MLP four times as wide,
    each added back to the residual stream."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                 nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Embeddings, ``cfg.layers`` blocks (``self.blocks``: FSDP's units), a LayerNorm and a head."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.block, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting each next character."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_formula(cfg: GPTConfig) -> int:
    """Every parameter, counted by hand."""
    d, v = cfg.d, cfg.vocab
    embeddings = (v + cfg.block) * d      # token and position tables
    # qkv 3d² + 3d, proj d² + d, MLP 8d² + 5d, two LayerNorms 4d
    per_block = 12 * d * d + 13 * d
    return embeddings + cfg.layers * per_block + 2 * d + d * v  # LN, head


def matmul_params(model: CharGPT) -> int:
    """N of 6 N: the parameters that take part in a matmul (all but the two embedding tables)."""
    lookups = {id(p) for p in (*model.tok.parameters(), *model.pos.parameters())}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def attention_flops_per_token(cfg: GPTConfig) -> int:
    """Attention's own training FLOPs per token, beyond 6 N: QK^T and att·V are 2 · 2 · block · d
    in forward per layer (counting the full square, which this plain attention computes before its
    mask, as Chowdhery et al.'s 12 L H Q T does), three times that with backward."""
    return 12 * cfg.layers * cfg.block * cfg.d
