"""Naive all-reduce: everyone sends its whole buffer to a root, the root sends the sum back.

    round 0 (reduce)        round 1 (broadcast)
    r1 --buf--> r0          r0 --sum--> r1
    r2 --buf--> r0          r0 --sum--> r2
    r3 --buf--> r0          r0 --sum--> r3

Two rounds, but the root receives and sends (p-1) full buffers while the others
idle: 2(p-1) n bytes through one port. The baseline every other algorithm beats.
The root adds the incoming buffers in rank order, so the result is deterministic.
"""

from __future__ import annotations

from dplab.reference.schedule import Schedule, Transfer, concat

__all__ = ["reduce", "broadcast", "allreduce"]


def reduce(p: int, root: int = 0) -> Schedule:
    sends = tuple(Transfer(r, root, 0, "reduce") for r in range(p) if r != root)
    return Schedule("naive_reduce", p, 1, (sends,) if sends else ())


def broadcast(p: int, root: int = 0) -> Schedule:
    sends = tuple(Transfer(root, r, 0, "copy") for r in range(p) if r != root)
    return Schedule("naive_broadcast", p, 1, (sends,) if sends else ())


def allreduce(p: int) -> Schedule:
    return concat("naive", reduce(p), broadcast(p))
