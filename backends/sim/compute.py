"""Torch operations on the virtual clock: ``TorchClock`` prices every aten operation a rank runs.

The reference MLP's operations come from its shapes (``dplab.reference.flops``); torch modules (DDP,
ZeRO-1, FSDP, lesson 14's GPT) run whatever operations they run, and ``TorchClock``, a
``TorchDispatchMode`` in the rank's main thread, hands each one to ``comm.compute`` as it happens:
FLOPs from torch's own registry (``torch.utils.flop_counter.flop_registry``, what
``FlopCounterMode`` counts), bytes from its tensors, the roofline on the rank's device. Views and
allocations are free; the simulator's own copies and sums (``uncharged``) are priced as transfers
and reductions instead. The host's time to run the operation never counts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TorchClock", "uncharged"]

_QUIET = threading.local()


@contextmanager
def uncharged() -> Iterator[None]:
    """Torch operations of this thread inside cost nothing (the simulator's own copies and sums)."""
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


def TorchClock(comm: Any) -> Any:  # noqa: N802 - a mode instance, built where torch is loaded
    """A ``TorchDispatchMode`` that prices this thread's aten operations on ``comm``'s device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    free = {
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.detach,
        aten.lift_fresh,
        aten.alias,
        aten._unsafe_view,
        aten.set_,
        aten.resize_,
    }  # and every view (func.is_view)

    class Clock(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            if getattr(_QUIET, "depth", 0) or packet in free or func.is_view:
                return out
            flops = (
                flop_registry[packet](*args, **kwargs, out_val=out)
                if packet in flop_registry
                else 0
            )
            tensors = [
                t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
            ]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dtype = next(
                (str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()),
                "float32",
            )
            comm.compute([(float(flops), float(nbytes))], dtype)
            return out

    return Clock()
