"""Where a local rank's buffers live: its shared-memory segments, staging, and peers' segments.

``comm.empty`` allocates a segment of its own (like registered memory in NCCL or
MPI_Alloc_mem); a send names a buffer by (segment, offset) so the receiver reads it straight
out of the sender's memory. A buffer outside every segment is first copied into a staging
segment (``bytes_staged`` counts those copies). Peers' segments are mapped on first use and
the least recently used are forgotten beyond ``PEER_CACHE`` (a mapping goes with its last view,
so a view still in use stays readable: ``shm.Segment``); the views a receive reads through are
kept (``VIEW_CACHE``). ``LocalComm`` (comm.py) holds the
state (``_segments``, ``_ranges``, ``_peers``, staging) that these methods share.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from dplab.backends.local.shm import Segment

__all__ = ["SegmentMemory", "PEER_CACHE", "VIEW_CACHE"]

PEER_CACHE = 32  # peer segments a rank keeps mapped (least recently used go first)
VIEW_CACHE = 4096  # views into peers' segments a rank keeps (all dropped when full)
_ALIGN = 64


class SegmentMemory:
    """The memory half of ``LocalComm``: allocation, locating a buffer for a peer, peer views."""

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        seg_id = self._new_segment(n)
        array = self._segments[seg_id].view(0, n, dtype).reshape(shape)
        weakref.finalize(array, self._free, seg_id)  # its memory goes when the array goes
        return array

    def _new_segment(self, nbytes: int) -> int:
        seg_id, self._next_id = self._next_id, self._next_id + 1
        seg = Segment(f"{self.w.session}_r{self.rank}_{seg_id}", nbytes, create=True)
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

    def _locate(self, buf: np.ndarray) -> tuple[int, int, bool]:
        """(segment id, offset, staged): where a peer can read ``buf`` from."""
        if buf.nbytes == 0:
            return -1, 0, False
        try:  # a third of what buf.ctypes.data costs (a microsecond, a fifth of a small round)
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
        seg_id, cap = self._staging
        if not self._staged_seqs:
            self._stage_top = 0
        if self._stage_top + buf.nbytes > cap:
            seg_id = self._new_segment(max(buf.nbytes, 2 * cap, 1 << 20))
            self._staging, self._stage_top = (seg_id, self._segments[seg_id].bytes.size), 0
        off = self._stage_top
        self._segments[seg_id].view(off, buf.nbytes, np.uint8)[:] = buf.reshape(-1).view(np.uint8)
        self.bytes_staged += buf.nbytes
        self._stage_top = off + -(-buf.nbytes // _ALIGN) * _ALIGN
        return seg_id, off, True

    def _peer_view(self, src: int, seg_id: int, off: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """A view of ``nbytes`` at ``off`` in ``src``'s segment ``seg_id``. Views are kept: a
        collective reads the same chunks of the same buffers call after call, and carving a view
        out of a mapping costs more than the reduction of a small chunk."""
        key = (src, seg_id, off, nbytes, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        seg = self._peers.get((src, seg_id))
        if seg is None:
            seg = self._peers[(src, seg_id)] = Segment(f"{self.w.session}_r{src}_{seg_id}")
            if len(self._peers) > PEER_CACHE:
                gone, old = self._peers.popitem(last=False)
                self._views = {k: v for k, v in self._views.items() if k[:2] != gone}
                old.close()
        else:
            self._peers.move_to_end((src, seg_id))
        if len(self._views) >= VIEW_CACHE:
            self._views.clear()
        view = self._views[key] = seg.view(off, nbytes, dtype)
        return view
