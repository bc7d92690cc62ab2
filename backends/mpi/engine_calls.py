"""What MPI itself does for a dplab rank: barrier, the native all-reduce, the control path.

``MpiComm`` (comm.py) moves a schedule's messages with ``Isend``/``Irecv``; these calls hand the
work to MPI's own collectives, each polled (``_poll``) so that it can time out: the barrier,
``MPI_Allreduce`` (the yardstick for our algorithms), and the pickled all-gather of results
and ``MPI_Abort`` that the launcher uses. float16 goes to ``MPI_Allreduce`` as MPI_FLOAT16_T
(MPI 4.1; MPICH 5.0.2 measured here rounds every partial sum to float16, as our schedules do:
1 + 2**-11 + 2**-11 on three ranks is 1.0, not 1.0009765625).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import numpy as np

from dplab.reference.communicator import ANY_SOURCE, BufferMismatch, Collective, CommError, require_writable
from dplab.reference.errors import ConfigError

__all__ = ["MpiEngineCalls"]

_DTYPES = [np.dtype(t) for t in ("uint8", "float32", "float64", "int32", "int64", "float16")]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}  # the dtype code in the low bits of a message's tag


class MpiEngineCalls:
    """The half of ``MpiComm`` that MPI's own collectives do (state and ``_poll`` live in comm.py)."""

    def barrier(self) -> None:
        self._poll(self._comm.Ibarrier(), None, "every rank to reach the barrier")

    def native_allreduce(self, buf: np.ndarray, op: str = "sum", check: bool = True) -> None:
        """MPI's own ``MPI_Allreduce``, in place: the yardstick for ours. MPI sums garbage when ranks
        pass different lengths, so with ``check`` a tiny all-reduce of (length, dtype) goes first,
        polled so that it can time out; after it every rank is inside this call and the real one
        runs as MPI users call it (a rank that dies in it ends the job: mpiexec stops the others)."""
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
        if check:  # max of (n, c, -n, -c) over ranks: agree or not
            self._tag = Collective("allreduce", "native").code()  # a peer in ours is caught by _peek
            shape = np.array([buf.size, _CODE[buf.dtype], -buf.size, -_CODE[buf.dtype]], np.int64)
            self._poll(self._comm.Iallreduce(MPI.IN_PLACE, shape, op=MPI.MAX), None,
                       "every rank to join the native all-reduce", ANY_SOURCE, peek=True)
            if shape[0] != -shape[2] or shape[1] != -shape[3]:
                raise BufferMismatch(
                    f"rank {self.rank} passed {buf.size} x {buf.dtype} to the native all-reduce but "
                    f"other ranks passed between {-shape[2]} and {shape[0]} elements or another dtype: "
                    "every rank must pass a buffer of the same length and dtype to a collective")
        self._comm.Allreduce(MPI.IN_PLACE, [buf, mpi_type], op=MPI.SUM)
        if op == "mean":
            buf /= self.world_size

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
