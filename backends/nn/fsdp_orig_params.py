"""FSDP's parameters as torch code sees them: original names, sharded values, a global clip.

    fsdp = FSDP(model, comm, units=list(model))
    dict(fsdp.named_parameters())     # {"0.weight": this rank's piece of it (1-D), "0.bias": ...}
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # steps the shards in place
    fsdp.clip_grad_norm_(1.0)         # the global norm over every rank's pieces (a collective)
    fsdp.state_dict()                 # the plain module's keys and full values (a collective)

As torch's FSDP1 with ``use_orig_params=True``: every parameter stays registered where it was, its
data and gradient views into its unit's flat shard (``fsdp_flat``), so shapes read outside
``summon_full_params`` are the 1-D pieces (maybe empty). ``clip_grad_norm_`` combines every rank's
local norm with torch's formula; ``torch.nn.utils.clip_grad_norm_`` on the pieces would clip each
rank by its own part. Why views and not shard objects: backends/nn/README.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dplab.backends.fastpath.executor import allgather
from dplab.backends.nn.flat import flat_buffer
from dplab.reference.communicator import Communicator

__all__ = ["OrigParams"]


class OrigParams:
    """named_parameters, state_dict, load_state_dict and clip_grad_norm_ for FSDP (a mixin)."""

    module: nn.Module
    comm: Communicator
    algorithm: str
    device: torch.device

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under its own names ("0.weight", not "module.0.weight"),
        each this rank's piece of it. ``parameters()`` yields the same tensors."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The plain module's state dict (full values, original keys), as torch's FSDP1 gives by
        default (FULL_STATE_DICT): ``full_state_dict()``, a collective."""
        out = OrderedDict() if destination is None else destination
        for key, value in self.full_state_dict().items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a plain module's state dict (``load_full_state_dict``: every key, no communication)."""
        self.load_full_state_dict(dict(state_dict))
        return nn.modules.module._IncompatibleKeys([], [])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every rank's gradient pieces so that the *global* norm is at most ``max_norm``;
        returns the global norm (the same on every rank). A collective: call it on every rank."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        dtype = grads[0].dtype if grads else torch.float64
        local = torch.nn.utils.get_total_norm([g for g in grads if g.numel()],  # an empty piece has no
                                              norm_type).to(torch.float64)      # inf-norm in torch
        total = _combine(self.comm, local, float(norm_type), self.algorithm, self.device).to(dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def _combine(comm: Communicator, local: torch.Tensor, norm_type: float, algorithm: str,
             device: torch.device) -> torch.Tensor:
    """The norm of every rank's ``local`` norm (one all-gather of a value per rank)."""
    buf, norms = flat_buffer(comm, comm.world_size, torch.float64, device)
    norms.zero_()
    norms[comm.rank] = local
    allgather(comm, buf, algorithm)
    return torch.linalg.vector_norm(norms.clone(), norm_type)
