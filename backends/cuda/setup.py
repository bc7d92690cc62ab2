"""Before a cuda world starts: is there a GPU, which GPU each rank gets, the hub its threads share.

A cuda world is one forked process holding every rank as a thread (``dplab.backends.launch.ranks``).
CUDA does not survive a fork: the launcher must not have used the GPU itself, so the GPUs are
counted through NVML (``torch.cuda.device_count``), which creates no CUDA context.
"""

from __future__ import annotations

from multiprocessing.context import BaseContext
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["available", "prepare", "device_of"]


def available() -> str | None:
    """None when a CUDA GPU can be used, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: pip install 'dplab[torch]' (a CUDA build)"
    if not torch.cuda.device_count():  # NVML where it can: no CUDA context in the launcher
        return "no CUDA GPU on this machine: use --backend local (or torch with --device cpu)"
    return None


def device_of(rank: int) -> Any:
    """Rank r computes on GPU r % (GPUs on this machine): several ranks per GPU, or one each."""
    import torch

    return torch.device("cuda", rank % torch.cuda.device_count())


def prepare(ctx: BaseContext, session: str, world_size: int, timeout: float) -> tuple[Any, Any]:
    """(connect(rank), nothing to keep): the hub is made here, before the ranks' process forks."""
    import torch

    from dplab.backends.cuda.comm import CudaComm
    from dplab.backends.cuda.hub import Hub

    if torch.cuda.is_initialized():
        raise ConfigError("this process has used CUDA already, and CUDA does not survive the "
                          "fork that starts a cuda world: start the world (launch, World) before "
                          "touching the GPU")
    hub = Hub(world_size, timeout)
    devices = [_DEVICE_OF(rank) for rank in range(world_size)]
    return (lambda rank: CudaComm(hub, devices, rank)), None


_DEVICE_OF = device_of  # the CPU tests of this transport put its ranks on the CPU here
