"""What MPI itself does for a dplab rank: barrier, the native all-reduce, the control path.

``MpiComm`` (comm.py) moves a schedule's messages with ``Isend``/``Irecv``; these calls hand the
work to MPI's own collectives, each polled (``_poll``) so that it can time out: the barrier,
``MPI_Allreduce`` (the yardstick for our algorithms), and the pickled all-gather of results
and ``MPI_Abort`` that the launcher uses. float16 goes to ``MPI_Allreduce`` as MPI_FLOAT16_T
(MPI 4.1; MPICH 5.0.2 rounds every partial sum to float16, as our schedules do:
1 + 2**-11 + 2**-11 on three ranks is 1.0, not 1.0009765625).
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Any

import numpy as np

from dplab.reference.communicator import ANY_SOURCE, BufferMismatch, Collective, CommError, require_writable
from dplab.reference.errors import ConfigError

__all__ = ["MpiEngineCalls"]

_DTYPES = [np.dtype(t) for t in ("uint8", "float32", "float64", "int32", "int64", "float16")]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}  # the dtype code in the low bits of a message's tag
_NATIVE = Collective("allreduce", "native").code()  # the native all-reduce's check messages carry it
_SIGNATURE = struct.Struct("=4q")  # (n, dtype, -n, -dtype): the max over ranks says if all agree
_TO_JOIN = "rank {peer} to join the native all-reduce"


class MpiEngineCalls:
    """The half of ``MpiComm`` that MPI's own collectives do (state and ``_poll`` live in comm.py)."""

    def barrier(self) -> None:
        self._poll(self._comm.Ibarrier(), None, "every rank to reach the barrier")

    def native_allreduce(self, buf: np.ndarray, op: str = "sum", check: bool = True) -> None:
        """MPI's own ``MPI_Allreduce``, in place: the yardstick for ours. MPI sums garbage (or waits
        forever) when ranks pass different lengths, so with ``check`` every rank first learns that
        all agree (``_agree``, polled so that it can time out); after it every rank is inside this
        call and the real one runs as MPI users call it (a rank that dies in it ends the job:
        mpiexec stops the others)."""
        MPI = self.MPI
        require_writable(buf)
        if op not in ("sum", "mean") or (op == "mean" and buf.dtype.kind != "f"):
            raise ConfigError(f"op must be 'sum' or 'mean' (floating point only), got {op!r} "
                              f"for {buf.dtype}")
        mpi_type = self._types.get(buf.dtype)
        if mpi_type is None and buf.dtype == np.float16:
            raise ConfigError(f"rank {self.rank}: this MPI has no float16 reduction (MPI_FLOAT16_T, "
                              "MPICH 4.2+): use algorithm ring, tree, naive or direct for float16")
        if mpi_type is None or not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: the native all-reduce needs a contiguous "
                            f"{', '.join(map(str, self._types))} array; got {buf.dtype}")
        if check and self.world_size > 1:
            self._agree(buf)
            if buf.size == 0:  # MPI_Allreduce of nothing returns at once, synchronising no one: a rank
                self.barrier()  # out early would reach a peer still in _agree, which reads its next
                return  # collective's message as a mismatch
        self._comm.Allreduce(MPI.IN_PLACE, [buf, mpi_type], op=MPI.SUM)
        if op == "mean":
            buf /= self.world_size

    def _agree(self, buf: np.ndarray) -> None:
        """Raise ``BufferMismatch`` on every rank unless every rank passed this length and dtype.

        Dissemination, by point-to-point messages: in round k = 0, 1, ... rank r sends the max of
        (n, dtype, -n, -dtype) it has seen to r + 2^k and takes the max with what r - 2^k sends;
        after ceil(log2 p) rounds every rank holds the max over all ranks, and max == -min for n and
        dtype only where every rank agrees. Why not ``MPI_Iallreduce`` of the same 4 integers: MPICH's
        non-blocking schedule costs more than these messages (backends/PERFORMANCE.md). The messages carry
        the native all-reduce's code in their tag, so a peer in another collective is a
        ``CollectiveMismatch`` at the first message, either way round."""
        self._tag = _NATIVE
        rounds = self._agreement or self._agreement_rounds()
        n, c = buf.size, _CODE[buf.dtype]
        hi = (n, c, -n, -c)
        try:
            for reqs, out, into, got, src, dst in rounds:
                _SIGNATURE.pack_into(out, 0, *hi)
                self.MPI.Prequest.Startall(reqs)
                self._complete_recv(reqs[0], got, src, _NATIVE, _TO_JOIN, ANY_SOURCE)
                if not reqs[1].Test():
                    self._poll(reqs[1], None, _TO_JOIN, dst, dst)
                theirs = _SIGNATURE.unpack_from(into)
                if theirs != hi:  # most calls agree and skip the map
                    hi = tuple(map(max, hi, theirs))
        except BaseException:  # a request may still be active: keep it (MPI may touch its buffer)
            self._abandoned.append(rounds)
            self._agreement = None
            raise
        if hi != (n, c, -n, -c):
            raise BufferMismatch(
                f"rank {self.rank} passed {n} x {buf.dtype} to the native all-reduce but other ranks "
                f"passed between {-hi[2]} and {hi[0]} elements or another dtype: every rank must "
                "pass a buffer of the same length and dtype to a collective")

    def _agreement_rounds(self) -> list[tuple]:
        """``_agree``'s rounds as persistent requests, made once per communicator (starting one
        is cheaper than a new ``Irecv`` + ``Isend``): per round, ([receive, send], the bytes sent,
        the bytes received, the received array, source, destination)."""
        MPI, p, r = self.MPI, self.world_size, self.rank
        tag, rounds, k = self._mpi_tag(_NATIVE) | _CODE[np.dtype(np.int64)], [], 1
        while k < p:
            src, dst = (r - k) % p, (r + k) % p
            mine, theirs = np.zeros(4, np.int64), np.zeros(4, np.int64)
            reqs = [self._comm.Recv_init([theirs, MPI.BYTE], src, MPI.ANY_TAG),
                    self._comm.Send_init([mine, MPI.BYTE], dst, tag)]
            rounds.append((reqs, mine.data.cast("B"), theirs.data.cast("B"), theirs, src, dst))
            k *= 2
        self._agreement = rounds
        return rounds

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (results for the launcher: pickle is fine here)."""
        what = "every rank to hand in its result"
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.world_size, np.int64)
        self._poll(self._comm.Iallgather(np.array([data.size], np.int64), sizes), None, what)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), np.uint8)
        self._poll(self._comm.Iallgatherv(data, [out, sizes, offsets, self.MPI.BYTE]), None, what)
        return [pickle.loads(out[a:a + n].tobytes()) for a, n in zip(offsets, sizes)]

    def abort(self, code: int = 1) -> None:
        """Stop every rank of the job now (MPI_Abort): one failed rank must not leave others waiting."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._comm.Abort(code)
