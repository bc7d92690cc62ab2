"""Before a local world starts: nothing to install, and the semaphores and control segment the
ranks share, made in the launcher before it forks them."""

from __future__ import annotations

import errno
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

from dplab.backends.local.comm import LocalComm
from dplab.backends.local.mailboxes import Wiring
from dplab.backends.local.shm import shm_full, unlink_prefix

__all__ = ["available", "prepare"]


def available() -> str | None:
    """Always None: NumPy and shared memory are all the local backend needs."""
    return None


def prepare(ctx: BaseContext, session: str, world_size: int, timeout: float) -> tuple[Any, Any]:
    """(connect(rank), the wiring to keep for the world's lifetime): its pid array lives in
    multiprocessing's shared heap, and a block freed early would be handed to the next world while
    ours still use it."""
    try:
        wiring = Wiring.create(ctx, session, world_size, timeout)
    except OSError as e:  # the semaphores and the heap live in /dev/shm too
        unlink_prefix(session)
        if e.errno != errno.ENOSPC:
            raise
        raise shm_full(4096 * (2 * world_size + 1) * world_size, "the ranks' semaphores") from None
    return partial(LocalComm, wiring), wiring
