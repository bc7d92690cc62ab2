"""The local backend's own all-reduce (``native``): one round, each rank reduces its chunk in place
in every rank's buffer.

    from dplab.backends import launch
    launch(lambda comm: comm.native_allreduce(comm.empty(1024, "float32")), 2)
    dplab bench --world-sizes 2 --sizes 4K,1M --algorithms ring,native    # measured against ring

Shared memory lets a rank write a peer's buffer, not only read it. Rank d owns chunk d
(``chunk_bounds(n, p)[d]``): it adds chunk d of every peer's buffer into its own chunk d, then
copies the sum into every peer's chunk d. No two ranks touch the same bytes (each only its own
chunk, in every buffer), so the only synchronisation is one round of descriptors ("here is my
buffer", the mailboxes of ``comm.py``) and one of acknowledgements ("I am done with yours"): a
rank returns once every peer has acknowledged, i.e. has finished reading and writing its
buffer. For p = 2 and chunks a, b:

    r0 [a0 b0]   r0 adds a1 into a0 and writes a01 into r1's a   |  r0 [a01 b01]
    r1 [a1 b1]   r1 adds b0 into b1 and writes b01 into r0's b   |  r1 [a01 b01]

The same bytes as ``direct`` (each rank reads (p-1) n/p of peers' memory and writes as much
instead of reading it a second time) in one round instead of two, and no snapshot: the one
round that ``recursive_doubling`` needs at p = 2 copies the whole buffer first. A buffer
outside shared memory goes out as a staged copy (``memory.py``): peers write their chunks into
that copy, so those are copied back once every peer is done. Rank d alone adds chunk d, in the
order d, d + 1, ..., p - 1, 0, ..., d - 1: every rank ends bitwise equal.

It is not a schedule of ``dplab.reference.algorithms``: a schedule's transfers move a chunk
to the rank that holds the result, and here the rank that computes a result writes it into
memory that another rank owns, which only shared memory can do.
"""

from __future__ import annotations

import numpy as np

from dplab.backends.local.wiring import CODE, DESC, DTYPES, SLOTS
from dplab.reference.communicator import COLLECTIVE_TAG, CommError

__all__ = ["OneShot"]


class OneShot:
    """The one-shot all-reduce half of ``LocalComm`` (which holds the mailboxes and segments)."""

    def _one_shot(self, flat: np.ndarray) -> None:
        """Sum the contiguous 1-D ``flat`` across all ranks in place, under this collective's tag."""
        me, p, tag = self.rank, self.world_size, self._tag
        code = CODE.get(flat.dtype)
        if code is None:
            raise CommError(f"rank {me}: the local backend moves {', '.join(map(str, CODE))}, "
                            f"got {flat.dtype}")
        peers = [*range(me + 1, p), *range(me)]
        seg_id, off, staged = self._locate(flat)
        seqs = [self._announce(q, seg_id, off, flat.nbytes, code, tag, staged) for q in peers]
        views = [self._take(q, flat, tag) for q in peers]  # every peer's buffer, checked first
        base, extra = divmod(len(flat), p)  # chunk_bounds(n, p)[me], without the other p - 1
        lo = me * base + min(me, extra)
        hi = lo + base + (me < extra)
        tr = self.tracer
        if hi > lo:
            mine = flat[lo:hi]
            t0 = tr.now() if tr.enabled else 0
            for v in views:
                if v is not None:
                    np.add(mine, v[lo:hi], out=mine)
            t1 = tr.now() if tr.enabled else 0
            for v in views:
                if v is not None:
                    np.copyto(v[lo:hi], mine)
            if tr.enabled:
                tr.record("reduce", t0, t1, peer=-1, bytes=mine.nbytes * (p - 1), chunk=me, round=0,
                          algorithm="native")
                tr.record("copy", t1, tr.now(), peer=-1, bytes=mine.nbytes * (p - 1), chunk=me,
                          round=0, algorithm="native")
        for q in peers:
            self._done_to[q].release()
        for q, seq in zip(peers, seqs):
            self._wait_ack(q, seq, tag >= COLLECTIVE_TAG)
        if staged and flat.nbytes:  # peers wrote their chunks into the staged copy: all but ours
            copy = self._segments[seg_id].view(off, flat.nbytes, flat.dtype)
            np.copyto(flat[:lo], copy[:lo])
            np.copyto(flat[hi:], copy[hi:])

    def _announce(self, dst: int, seg_id: int, off: int, nbytes: int, code: int, tag: int,
                  staged: bool) -> int:
        """Post a descriptor of memory already located (``_post`` without ``_locate``)."""
        seq = self._send_seq[dst]
        if seq - self._acked[dst] >= SLOTS:
            self._wait_ack(dst, seq - SLOTS)
        DESC.pack_into(self._ctl, self._slot(self.rank, dst, seq), seg_id, off, nbytes, code, tag)
        self._send_seq[dst] = seq + 1
        if staged:
            self._staged_seqs.append((dst, seq))
        self._ready_to[dst].release()
        self.w.arrival[dst].release()
        return seq

    def _take(self, src: int, flat: np.ndarray, tag: int) -> np.ndarray | None:
        """The next message from ``src``, checked against ``flat`` and ``tag`` like a receive, as a
        writable view of the peer's memory (None when empty); its ack is the caller's to post."""
        if not self._ready_from[src].acquire(False):
            self._acquire(self._ready_from[src], "for its message", src)
        seq = self._recv_seq[src]
        seg, off, nbytes, code, mtag = DESC.unpack_from(self._ctl, self._slot(src, self.rank, seq))
        self._recv_seq[src] = seq + 1
        if mtag != tag or nbytes != flat.nbytes or DTYPES[code] != flat.dtype:
            self._done_to[src].release()  # as a receive does: the peer's send is over, ours is refused
            self._refuse(flat, src, tag, mtag, nbytes, code)
        return self._peer_view(src, seg, off, nbytes, DTYPES[code]) if nbytes else None
