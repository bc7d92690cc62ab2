"""Which FSDP unit owns which parameter: the units checked, tied parameters placed once.

    plan = plan_units(model, [model.encoder, model.decoder])
    plan[0]   # the root unit ("", model): every parameter no listed unit owns on its own
    plan[1]   # ("encoder", model.encoder, [(param, holders), ...])

A unit owns a parameter when every module that holds it (a parameter tied between two modules
has two holders) lies inside that unit; a parameter tied across two units belongs to neither
and goes to the root, which is gathered for the whole forward and backward: it is flattened
once, its gradient (the sum over both uses, as autograd accumulates it) reduced once. Units may
not contain each other: the root is the only unit that holds others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dplab.backends.nn.fsdp_flat import Holder
from dplab.reference.errors import ConfigError

__all__ = ["UnitPlan", "plan_units", "param_keys"]


@dataclass
class UnitPlan:
    """A unit before flattening: its name in the module, the submodule, its parameters in order."""

    name: str
    module: nn.Module
    params: list[torch.Tensor] = field(default_factory=list)
    holders: list[list[Holder]] = field(default_factory=list)


def _holders(module: nn.Module) -> dict[int, list[Holder]]:
    """id(parameter) -> every (module, attribute) that holds it, shared submodules counted once."""
    out: dict[int, list[Holder]] = {}
    seen: set[tuple[int, str]] = set()
    for mod in module.modules():  # deduplicated modules: a shared submodule is one holder
        for name, p in mod._parameters.items():
            if p is not None and (id(mod), name) not in seen:
                seen.add((id(mod), name))
                out.setdefault(id(p), []).append((mod, name))
    return out


def _check(module: nn.Module, units: Sequence[nn.Module]) -> list[str]:
    """The units' names in ``module``; a ConfigError that says what to change otherwise."""
    names = {id(m): n for n, m in module.named_modules()}
    out = []
    for i, u in enumerate(units):
        if not isinstance(u, nn.Module):
            raise ConfigError(f"units[{i}] is a {type(u).__name__}, not an nn.Module: "
                              "list submodules of the wrapped module (e.g. "
                              "units=list(model.layers))")
        if u is module:
            raise ConfigError("the wrapped module itself is always the root unit: list only "
                              "its submodules (units=None puts the whole model in one unit)")
        if id(u) not in names:
            raise ConfigError(f"units[{i}] ({type(u).__name__}) is not inside the wrapped "
                              "module: list submodules of the module you wrap (the same "
                              "objects, not copies)")
        out.append(names[id(u)])
    for i, u in enumerate(units):
        inner = {id(m) for m in u.modules()}
        for j, v in enumerate(units):
            if i != j and id(v) in inner:
                what = "listed twice" if u is v else f"inside unit {out[i]!r}"
                raise ConfigError(f"units overlap: unit {out[j]!r} is {what}; a parameter needs "
                                  "exactly one unit: list either the outer module or the "
                                  "inner ones")
    return out


def plan_units(module: nn.Module, units: Sequence[nn.Module] | None) -> list[UnitPlan]:
    """The root unit first, then one plan per listed unit, each with the parameters it owns."""
    units = list(units or [])
    names = _check(module, units)
    plans = [UnitPlan("", module)] + [UnitPlan(n, u) for n, u in zip(names, units)]
    members = [{id(m) for m in u.modules()} for u in units]
    holders = _holders(module)
    for _, p in module.named_parameters():  # named_parameters() dedupes tied weights: once each
        hs = holders[id(p)]
        owner = next((k + 1 for k, inside in enumerate(members)
                      if all(id(mod) in inside for mod, _ in hs)), 0)
        plans[owner].params.append(p)
        plans[owner].holders.append(hs)
    return plans


def param_keys(module: nn.Module) -> dict[str, int]:
    """Every state-dict key of a parameter -> id(parameter): a tied weight has several keys."""
    out: dict[str, int] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None:
                out[f"{prefix}.{name}" if prefix else name] = id(p)
    return out
