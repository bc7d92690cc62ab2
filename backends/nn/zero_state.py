"""ZeRO's optimizer state, sharded and whole: between flat shards and torch's state dict.

    opt.consolidate_state_dict(to=0)       # every rank: all-gather each flat state tensor
    sd = opt.state_dict()                  # rank 0: {"state": {i: {...}}, "param_groups": [...]}
    opt.load_state_dict(sd)                # every rank: its own shards out of the whole

The inner optimizer of a ZeRO rank steps one flat tensor per parameter group, so its state
is, per group, a few flat tensors of the shard's length (Adam's ``exp_avg``) and a few
per-tensor values (Adam's ``step``). The unsharded optimizer (``torch.optim.AdamW`` over the
module) keeps the same numbers per parameter. Going from one to the other is bookkeeping:
all-gather each flat tensor into the group's flat layout and cut it at the parameters'
slices (``gather_state``, ``full_state_dict``); or concatenate the parameters' tensors and
keep this rank's chunk (``load_full_state``). The per-tensor values are the same for every
parameter of a group, as every shard steps at every step.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dplab.backends.fastpath.executor import allgather
from dplab.backends.nn.flat import flat_buffer
from dplab.reference.errors import ConfigError

__all__ = ["gather_state", "full_state_dict", "load_full_state", "per_element", "Sharded"]


class Sharded(Protocol):
    """What these functions read of a ZeRO optimizer (``ZeroRedundancyOptimizer`` is one): the
    communicator and algorithm it gathers with, its flat groups, the inner optimizer stepping the
    shards, and torch's ``param_groups``."""

    comm: Any
    algorithm: str
    groups: list[Any]
    optim: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]

PER_TENSOR = ("step", "eta", "mu")  # torch optimizers' per-tensor scalars (Adam*, ASGD)
_CARRIED = (torch.float32, torch.float64, torch.int32, torch.int64)  # what allgather moves


def per_element(key: str, value: Any, like: torch.Tensor) -> bool:
    """Is ``value`` one number per element of ``like`` (sharded), or one per tensor (replicated)?"""
    return isinstance(value, torch.Tensor) and key not in PER_TENSOR and value.shape == like.shape


def gather_state(zero: Sharded) -> list[dict[str, Any]]:
    """Per group, its whole flat state: each per-element tensor all-gathered (a collective, the
    same sequence on every rank), each per-tensor value as this rank has it."""
    out = []
    for g in zero.groups:
        state = zero.optim.state.get(g.shard, {})
        whole: dict[str, Any] = {}
        for key, value in state.items():  # the same keys, in the same order, on every rank
            if not per_element(key, value, g.shard):
                whole[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            if value.dtype not in _CARRIED:
                raise ConfigError(f"optimizer state {key!r} is {value.dtype}: ZeRO gathers only "
                                  f"{', '.join(map(str, _CARRIED))}")
            buf, flat = flat_buffer(zero.comm, g.n, value.dtype, value.device)
            flat[slice(*g.bounds)].copy_(value)
            allgather(zero.comm, buf, zero.algorithm)
            whole[key] = flat.clone()  # out of the communicator's (shared) memory
        out.append(whole)
    return out


def _indices(zero: Sharded, groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(parameter) -> its index in a packed state dict (the numbering ``torch.optim`` uses)."""
    return {id(p): i for ours, packed in zip(zero.param_groups, groups)
            for p, i in zip(ours["params"], packed["params"])}


def full_state_dict(zero: Sharded, gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The unsharded optimizer's state dict from ``gather_state``'s flat state."""
    packed = torch.optim.Optimizer.state_dict(zero)  # param_groups as torch numbers them; no state
    index = _indices(zero, packed["param_groups"])
    state: dict[int, dict[str, Any]] = {}
    for g, whole in zip(zero.groups, gathered):
        if not whole:
            continue  # never stepped
        for p, s in zip(g.params, g.slices):
            state[index[id(p)]] = {
                k: v[s].view_as(p).clone() if per_element(k, v, g.flat_param)
                else v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in whole.items()}
    return {"state": dict(sorted(state.items())), "param_groups": packed["param_groups"]}


def load_full_state(zero: Sharded, state_dict: dict[str, Any]) -> None:
    """Keep this rank's shards of an unsharded state dict; take its groups' options."""
    saved = state_dict["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in zero.param_groups]:
        raise ConfigError(f"the state dict has groups of {[len(g['params']) for g in saved]} "
                          "parameters, this optimizer "
                          f"{[len(g['params']) for g in zero.param_groups]}: load it into an "
                          "optimizer over the same parameter groups")
    index = _indices(zero, saved)
    for k, (g, ours, theirs) in enumerate(zip(zero.groups, zero.param_groups, saved)):
        states = [state_dict["state"].get(index[id(p)]) for p in g.params]
        zero.optim.state.pop(g.shard, None)
        if all(s is None for s in states):
            pass
        elif any(s is None for s in states):
            raise ConfigError(f"group {k}: some parameters have optimizer state and some none; "
                              "a flat shard steps all of them: save the state after a step of "
                              "every parameter")
        else:
            zero.optim.state[g.shard] = _shard_of(g, states, k)
        ours.update({key: v for key, v in theirs.items() if key not in ("params", "param_names")})


def _shard_of(g: Any, states: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """This rank's chunk of the group's per-element state; the per-tensor values, checked equal."""
    local: dict[str, Any] = {}
    for key in states[0]:
        values = [s[key] for s in states]
        if all(per_element(key, v, p) for v, p in zip(values, g.params)):
            flat = torch.cat([v.reshape(-1) for v in values]) if values else g.flat_param[:0]
            if flat.is_floating_point():
                flat = flat.to(g.flat_param)  # as torch.optim casts state to its parameter
            local[key] = flat[slice(*g.bounds)].clone()
            continue
        first = values[0]
        if not all(_equal(v, first) for v in values):
            raise ConfigError(f"group {k}: {key!r} differs between parameters ({values[0]} "
                              "vs others); a flat shard keeps one: parameters that skipped steps "
                              "cannot share a shard")
        local[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return local


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
