"""Where a local rank's buffers live: its shared-memory segments, staging, and peers' segments.

``empty`` allocates a segment of its own (like registered memory in NCCL or MPI_Alloc_mem); a
send names a buffer by (segment, offset) so the receiver reads it straight out of the sender's
memory. A buffer outside every segment is first copied into a staging segment (``bytes_staged``
counts those copies); staging space is reused once every staged send has been taken. Peers'
segments are mapped on first use and the least recently used are forgotten beyond
``PEER_CACHE`` (a mapping goes with its last view, so a view still in use stays readable:
``shm.Segment``); the views a receive reads through are kept (``VIEW_CACHE``): a collective reads
the same chunks of the same buffers call after call, and carving a view costs more than
reducing a small chunk.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict, deque

import numpy as np

from dplab.backends.local.shm import Segment

__all__ = ["Memory", "PEER_CACHE", "VIEW_CACHE"]

PEER_CACHE = 32  # peer segments a rank keeps mapped (least recently used go first)
VIEW_CACHE = 4096  # views into peers' segments a rank keeps (all dropped when full)
_ALIGN = 64


class Memory:
    """One rank's shared memory. ``acked`` is the mailboxes' count of messages each peer has
    taken (read only here): a staged send's bytes may be overwritten once it is taken."""

    def __init__(self, session: str, rank: int, acked: list[int]) -> None:
        self._session, self._rank, self._acked = session, rank, acked
        self._segments: dict[int, Segment] = {}  # mine, by id (ids are never reused)
        self._ranges: dict[int, tuple[int, int]] = {}  # id -> (address, size) of each of mine
        # (id, address, size) last found by locate
        self._last_range: tuple[int, int, int] = (-1, 0, 0)
        self._next_id = 0
        self._staging: tuple[int, int] = (-1, 0)  # (segment id, capacity)
        self._stage_top = 0  # bump pointer into the staging segment
        self._staged: deque[tuple[int, int]] = deque()  # (dst, seq) of staged sends not yet taken
        self._peers: OrderedDict[tuple[int, int], Segment] = OrderedDict()  # (rank, id), LRU
        self._views: dict[tuple, np.ndarray] = {}  # (rank, id, offset, bytes, dtype) -> view
        self.bytes_staged = 0  # copies made because a send buffer was not in shared memory

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        """An array in a segment of its own, unlinked when the array goes."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        seg_id = self._new_segment(n)
        array = self._segments[seg_id].view(0, n, dtype).reshape(shape)
        weakref.finalize(array, self._free, seg_id)
        return array

    def locate(self, buf: np.ndarray) -> tuple[int, int, bool]:
        """(segment id, offset, staged): where a peer can read ``buf``
        from, staging it if need be."""
        if buf.nbytes == 0:
            return -1, 0, False
        try:  # cheaper than buf.ctypes.data, and this runs for every send
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        except (TypeError, ValueError, BufferError):  # read-only: it exports no writable view
            addr = buf.ctypes.data
        seg_id, base, size = self._last_range  # a round's sends mostly come from one segment
        if base <= addr and addr + buf.nbytes <= base + size:
            return seg_id, addr - base, False
        for seg_id, (base, size) in self._ranges.items():
            if base <= addr and addr + buf.nbytes <= base + size:
                self._last_range = (seg_id, base, size)
                return seg_id, addr - base, False
        return self._stage(buf)

    def staged_sent(self, dst: int, seq: int) -> None:
        """The staged buffer just located went to ``dst`` as message
        ``seq``: keep it until taken."""
        self._staged.append((dst, seq))

    def view(self, seg_id: int, off: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """A view of ``nbytes`` at ``off`` in one of this rank's own segments."""
        return self._segments[seg_id].view(off, nbytes, dtype)

    def peer_view(self, src: int, seg_id: int, off: int, nbytes: int,
                  dtype: np.dtype) -> np.ndarray:
        """A view of ``nbytes`` at ``off`` in ``src``'s segment
        ``seg_id`` (kept for the next call)."""
        key = (src, seg_id, off, nbytes, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        if len(self._views) >= VIEW_CACHE:
            self._views.clear()
        view = self._views[key] = self._peer_segment(src, seg_id).view(off, nbytes, dtype)
        return view

    def close(self) -> None:
        self._views.clear()
        for seg in [*self._peers.values(), *self._segments.values()]:
            seg.close()
        self._peers.clear()

    def _stage(self, buf: np.ndarray) -> tuple[int, int, bool]:
        """Copy ``buf`` into the staging segment (grown when full); staging restarts at its start
        once every staged send has been taken."""
        while self._staged and self._acked[self._staged[0][0]] > self._staged[0][1]:
            self._staged.popleft()
        seg_id, cap = self._staging
        if not self._staged:
            self._stage_top = 0
        if self._stage_top + buf.nbytes > cap:
            seg_id = self._new_segment(max(buf.nbytes, 2 * cap, 1 << 20))
            self._staging, self._stage_top = (seg_id, self._segments[seg_id].bytes.size), 0
        off = self._stage_top
        self._segments[seg_id].view(off, buf.nbytes, np.uint8)[:] = buf.reshape(-1).view(np.uint8)
        self.bytes_staged += buf.nbytes
        self._stage_top = off + -(-buf.nbytes // _ALIGN) * _ALIGN
        return seg_id, off, True

    def _peer_segment(self, src: int, seg_id: int) -> Segment:
        """``src``'s segment, mapped on first use; beyond PEER_CACHE the least recently used goes,
        with its views."""
        seg = self._peers.get((src, seg_id))
        if seg is not None:
            self._peers.move_to_end((src, seg_id))
            return seg
        seg = self._peers[(src, seg_id)] = Segment(f"{self._session}_r{src}_{seg_id}")
        if len(self._peers) > PEER_CACHE:
            gone, old = self._peers.popitem(last=False)
            self._views = {k: v for k, v in self._views.items() if k[:2] != gone}
            old.close()
        return seg

    def _new_segment(self, nbytes: int) -> int:
        seg_id, self._next_id = self._next_id, self._next_id + 1
        seg = Segment(f"{self._session}_r{self._rank}_{seg_id}", nbytes, create=True)
        self._segments[seg_id] = seg
        self._ranges[seg_id] = (seg.bytes.ctypes.data, seg.bytes.size)
        return seg_id

    def _free(self, seg_id: int) -> None:
        """Forget and unlink a segment; peers that mapped it keep their mapping until evicted."""
        self._ranges.pop(seg_id, None)
        if self._last_range[0] == seg_id:
            self._last_range = (-1, 0, 0)
        seg = self._segments.pop(seg_id, None)
        if seg is not None:
            seg.close()
            seg.unlink()
