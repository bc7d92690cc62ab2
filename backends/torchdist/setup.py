"""Before a torch.distributed world starts: is gloo there, which device, how long to wait.

``--device cuda`` (``DPLAB_DEVICE=cuda``) picks NCCL, one GPU per rank; with fewer GPUs than
ranks it is a ``ConfigError``. torch is imported on first use, so importing dplab stays cheap.
This file imports nothing else of the torch backend: ``p2p``, ``comm`` and ``rendezvous`` build
on it, in that order.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from functools import cache
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["available", "wants_cuda", "startup_timeout", "torch_modules"]


@cache
def torch_modules() -> tuple[Any, Any]:
    """(torch, torch.distributed), imported on first use: importing dplab stays cheap."""
    return importlib.import_module("torch"), importlib.import_module("torch.distributed")


def available() -> str | None:
    """None when torch.distributed with gloo can be used, else why not and what to install."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed: pip install 'dplab[torch]'"
    gloo = dist.is_available() and dist.is_gloo_available()
    return None if gloo else ("this torch lacks torch.distributed/gloo: "
                              "pip install 'dplab[torch]' (official)")


def startup_timeout(timeout: float) -> timedelta:
    """Start-up may take seconds (imports, NCCL); ``timeout`` is for peers' waits afterwards."""
    return timedelta(seconds=max(timeout, 60.0))


def wants_cuda(device: str | None, local_ranks: int) -> bool:
    """True for NCCL on GPUs, False for gloo on CPU; a ConfigError when GPUs are short."""
    kind = (device or os.environ.get("DPLAB_DEVICE") or "cpu").split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {kind!r}")
    # NVML: fork-safe
    if kind == "cuda" and (have := torch_modules()[0].cuda.device_count()) < local_ranks:
        raise ConfigError(f"{local_ranks} ranks need {local_ranks} GPUs, this machine has {have}: "
                          "use --device cpu (gloo), i.e. DPLAB_DEVICE=cpu")
    return kind == "cuda"
