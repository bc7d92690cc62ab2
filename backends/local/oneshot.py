"""The local backend's own all-reduce (``native``): one round, each rank reduces its chunk in place
in every rank's buffer.

    from dplab.backends import launch
    launch(lambda comm: comm.native_allreduce(comm.empty(1024, "float32")), 2)
    dplab bench --world-sizes 2 --sizes 4K,1M --algorithms ring,native    # measured against ring

Rank d owns chunk d (``chunk_bounds(n, p)[d]``): it adds chunk d of every peer's buffer into its
own, in the order d, d + 1, ..., d - 1, then writes the sum into every peer's chunk d, so every
rank ends bitwise equal. No two ranks touch the same bytes; one round of descriptors
(``mailboxes.py``) and one of acknowledgements suffice, and a rank returns once every peer is
done with its buffer. For p = 2 and chunks a, b:

    r0 [a0 b0]   r0 adds a1 into a0 and writes a01 into r1's a   |  r0 [a01 b01]
    r1 [a1 b1]   r1 adds b0 into b1 and writes b01 into r0's b   |  r1 [a01 b01]

Not a schedule of ``dplab.reference.algorithms``: it writes into memory another rank owns, which
only shared memory allows. A buffer outside shared memory is staged and copied back after.
"""

from __future__ import annotations

import numpy as np

from dplab.backends.local.mailboxes import CODE, DTYPES, Mailboxes, refusal
from dplab.backends.local.memory import Memory
from dplab.reference.communicator import CommError
from dplab.reference.trace import Tracer

__all__ = ["one_shot"]


def one_shot(mailboxes: Mailboxes, memory: Memory, flat: np.ndarray, tag: int,
             tracer: Tracer) -> None:
    """Sum the contiguous 1-D ``flat`` across all ranks in place; its messages carry ``tag``."""
    me, p = mailboxes.rank, mailboxes.world_size
    code = CODE.get(flat.dtype)
    if code is None:
        raise CommError(f"rank {me}: the local backend moves {', '.join(map(str, CODE))}, got "
                        f"{flat.dtype}")
    peers = [*range(me + 1, p), *range(me)]
    seg_id, off, staged = memory.locate(flat)
    seqs = [mailboxes.post(q, seg_id, off, flat.nbytes, code, tag) for q in peers]
    if staged:
        for q, seq in zip(peers, seqs):
            memory.staged_sent(q, seq)
    # every peer's buffer, checked first
    views = [_take(mailboxes, memory, q, flat, tag) for q in peers]
    base, extra = divmod(len(flat), p)  # chunk_bounds(n, p)[me], without the other p - 1
    lo = me * base + min(me, extra)
    hi = lo + base + (me < extra)
    if hi > lo:
        _reduce_and_spread(flat[lo:hi], [v[lo:hi] for v in views if v is not None], me, p, tracer)
    for q in peers:
        mailboxes.ack(q)
    for q, seq in zip(peers, seqs):
        mailboxes.wait_ack(q, seq, tag)
    if staged and flat.nbytes:  # peers wrote their chunks into the staged copy: all but ours
        copy = memory.view(seg_id, off, flat.nbytes, flat.dtype)
        np.copyto(flat[:lo], copy[:lo])
        np.copyto(flat[hi:], copy[hi:])


def _reduce_and_spread(mine: np.ndarray, theirs: list[np.ndarray], me: int, p: int,
                       tracer: Tracer) -> None:
    """Add every peer's chunk into ``mine``, then write the sum into every peer's chunk."""
    t0 = tracer.now() if tracer.enabled else 0
    for v in theirs:
        np.add(mine, v, out=mine)
    t1 = tracer.now() if tracer.enabled else 0
    for v in theirs:
        np.copyto(v, mine)
    if tracer.enabled:
        tracer.record("reduce", t0, t1, peer=-1, bytes=mine.nbytes * (p - 1), chunk=me, round=0,
                      algorithm="native")
        tracer.record("copy", t1, tracer.now(), peer=-1, bytes=mine.nbytes * (p - 1), chunk=me,
                      round=0, algorithm="native")


def _take(mailboxes: Mailboxes, memory: Memory, src: int, flat: np.ndarray,
          tag: int) -> np.ndarray | None:
    """The next message from ``src``, checked against ``flat`` and ``tag`` like a receive, as a
    writable view of the peer's memory (None when empty); its ack is the caller's to post."""
    seg, off, nbytes, code, mtag = mailboxes.take(src)
    if mtag != tag or nbytes != flat.nbytes or DTYPES[code] != flat.dtype:
        mailboxes.ack(src)  # as a receive does: the peer's send is over, ours is refused
        raise refusal(mailboxes.rank, flat, src, tag, mtag, nbytes, code)
    return memory.peer_view(src, seg, off, nbytes, DTYPES[code]) if nbytes else None
