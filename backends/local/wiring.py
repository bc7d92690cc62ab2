"""What the launcher creates before forking the local backend's ranks: everything they share.

Besides the semaphores of the mailboxes (``dplab.backends.local.comm``), the wiring holds each
rank's process id, written by the rank itself when it connects. That is how a rank of
the shared-memory backend can tell that a peer is DEAD rather than slow
(``peer_alive``): a receive from ANY_SOURCE hears nothing from a dead rank, ever, and
only a look at the process can tell the two apart. The parameter server uses it to go
on without a worker killed mid-run (``dplab.reference.ps.server``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from dplab.backends.local.shm import Segment

__all__ = ["Wiring", "SLOTS", "DESC", "DTYPES", "CODE", "process_alive"]

SLOTS = 64  # descriptors in each (src, dst) mailbox
DESC = struct.Struct("5q")  # a message's descriptor: segment id, offset, bytes, dtype code, tag
DTYPES = [np.dtype(t) for t in ("uint8", "float32", "float64", "int32", "int64", "float16")]
CODE = {dt: i for i, dt in enumerate(DTYPES)}  # a dtype's code in a descriptor


@dataclass
class Wiring:
    """Semaphores, the control segment's name, and the ranks' pids (0 until a rank connects)."""

    session: str
    world_size: int
    timeout: float
    ready: list  # ready[src][dst]: a descriptor from src waits in dst's mailbox
    done: list  # done[src][dst]: dst has finished reading a message of src
    arrival: list  # arrival[dst]: some message waits for dst
    pids: Any = None  # shared int64 array: pids[r] is rank r's process id

    @classmethod
    def create(cls, ctx: BaseContext, session: str, p: int, timeout: float) -> Wiring:
        ctl = Segment(f"{session}_ctl", p * p * SLOTS * DESC.size, create=True)
        ctl.close()
        sems = [[ctx.Semaphore(0) for _ in range(p)] for _ in range(2 * p)]
        return cls(session, p, timeout, sems[:p], sems[p:], [ctx.Semaphore(0) for _ in range(p)],
                   ctx.Array("q", p, lock=False))


def process_alive(pid: int) -> bool:
    """Is ``pid`` a live process? A killed child the launcher has not reaped yet is a zombie:
    it still "exists" for ``os.kill(pid, 0)``, so read its state from /proc instead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
