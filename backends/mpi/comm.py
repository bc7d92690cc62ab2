"""The MPI backend: ranks are MPI processes, bytes move through mpi4py's buffer API.

    mpiexec -n 4 dplab train --backend mpi                  # under MPI's own launcher
    launch(fn, 4, backend="mpi")                            # mpiexec started for you
    dplab bench --backend mpi --world-sizes 2,4 --algorithms ring,native

What this file adds to MPI's ordered point-to-point messages, for the Communicator contract: every
wait polls ``Test`` and ends in ``CommTimeout`` naming the peer (how it waits: backends/README.md);
an MPI tag is ``16 * tag + dtype code`` and receives accept any tag, so messages between two ranks
match in order and a collective's code, length and dtype are checked: another collective,
algorithm or root is a ``CollectiveMismatch`` (1), another buffer a ``BufferMismatch`` (2), and a
sender left waiting probes its peer's message (3). dplab talks on a duplicate of the communicator
it is given; ``hosts`` comes from ``Split_type(COMM_TYPE_SHARED)``. MPI's own collectives close
the class: the barrier, ``MPI_Allreduce`` as ``native`` (after every rank agrees on length and
dtype), the results' all-gather and ``MPI_Abort``. float16 goes to ``MPI_Allreduce`` as
MPI_FLOAT16_T (MPI 4.1), every partial sum rounded to float16 as our schedules do. Importing this
module does not start MPI: ``mpi4py.MPI`` (MPI_Init) is imported when a communicator is built.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from dplab.reference.communicator import (
    ANY_SOURCE,
    COLLECTIVE_TAG,
    BufferMismatch,
    Collective,
    CommError,
    CommTimeout,
    Communicator,
    RecvSpec,
    SendSpec,
    collective_mismatch,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.trace import Tracer

__all__ = ["MpiComm", "ANY_TAG"]

ANY_TAG = -1
_TAG_BITS = 4  # the low bits of an MPI tag hold the sender's dtype code
_SPIN_S = 0.02  # poll without sleeping this long, only yielding the core between polls
_NAP_S = (20e-6, 1e-3)  # then nap 1/20 of the time waited so far, within these bounds
_ALIGN = 64
_TO_TAKE = "rank {peer} to take its message"
_DTYPES = [np.dtype(t) for t in ("uint8", "float32", "float64", "int32", "int64", "float16")]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}  # the dtype code in the low bits of a message's tag
# the native all-reduce's check messages carry it
_NATIVE = Collective("allreduce", "native").code()
_SIGNATURE = struct.Struct("=4q")  # (n, dtype, -n, -dtype): the max over ranks says if all agree
_TO_JOIN = "rank {peer} to join the native all-reduce"


class _Request:
    """A posted ``Isend``/``Irecv``; ``wait`` polls it so that it can time out."""

    __slots__ = ("comm", "req", "buf", "peer", "tag")

    def __init__(self, comm: MpiComm, req: Any, buf: np.ndarray, peer: int,
                 tag: int | None) -> None:
        self.comm, self.req, self.buf, self.peer, self.tag = comm, req, buf, peer, tag

    def wait(self) -> int | None:
        """The source rank of a receive; None for a send (``tag`` is
        None). Waiting twice is fine."""
        if self.tag is None:
            self.comm._poll(self.req, None, _TO_TAKE, self.peer)
        elif self.req is not None:
            self.peer, self.req = self.comm._complete_recv(self.req, self.buf, self.peer,
                                                           self.tag), None
        return None if self.tag is None else self.peer


class MpiComm(Communicator):
    """A Communicator over an MPI communicator (``MPI.COMM_WORLD`` unless told otherwise)."""

    backend = "mpi"

    def __init__(self, comm: Any = None, timeout: float = 60.0) -> None:
        from mpi4py import MPI  # starts MPI (MPI_Init_thread) on first import

        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        self.timeout, self.tracer = timeout, Tracer(self.rank)
        self.hosts = self._host_keys()
        self._max_tag = self._comm.Get_attr(MPI.TAG_UB) >> _TAG_BITS
        self._types = {np.dtype("float32"): MPI.FLOAT, np.dtype("float64"): MPI.DOUBLE,
                       np.dtype("int32"): MPI.INT32_T, np.dtype("int64"): MPI.INT64_T}
        half = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)  # MPI 4.1's; MPICH >= 4.2 sums it
        if half != MPI.DATATYPE_NULL:
            self._types[np.dtype("float16")] = half
        # a scratch arena per thread (the reducer's runs rounds too)
        self._local = threading.local()
        # timed-out requests MPI may still touch: keep their buffers
        self._abandoned: list[Any] = []
        self._tag = 0  # the tag of the running collective's messages (its code; see check_buffer)
        self._agreement: list | None = None  # the native all-reduce's check, as persistent requests

    def _host_keys(self) -> np.ndarray:
        """Each rank's host, as MPI knows it: the ranks that can share memory (MPI_Comm_split_type
        with MPI_COMM_TYPE_SHARED; under hydra, the ranks one proxy, i.e. one -hosts entry, started)
        name their host by its lowest rank, and every rank gathers every rank's name."""
        MPI = self.MPI
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            first = np.array([self.rank], np.int64)
            local.Allreduce(MPI.IN_PLACE, first, op=MPI.MIN)
        finally:
            local.Free()
        keys = np.empty(self.world_size, np.int64)
        self._comm.Allgather(first, keys)
        return keys

    @classmethod
    def from_launcher(cls, timeout: float) -> MpiComm:
        """The communicator of a job started by a real ``mpiexec``: COMM_WORLD."""
        return cls(None, timeout)

    # -- waiting ----------------------------------------------------------------------------
    def _poll(self, req: Any, status: Any, what: str, peer: int = -1,
              peek: int | None = None) -> None:
        """Wait for ``req`` by polling (see the module docstring); ``what`` names it on timeout.
        ``peek``: a rank (or ANY_SOURCE) whose message to us is probed while napping: one of another
        collective means its sender is in that one (``_peek``)."""
        if req.Test(status):
            return
        start = time.monotonic()
        while not req.Test(status):
            waited = time.monotonic() - start
            if waited < _SPIN_S:
                os.sched_yield()
            elif waited < self.timeout:
                if peek is not None:
                    self._peek(peek)
                time.sleep(min(max(waited / 20, _NAP_S[0]), _NAP_S[1]))
            else:
                self._abandon(req)
                who = what.format(peer=peer)
                raise CommTimeout(f"rank {self.rank} waited {self.timeout:.0f}s for {who}: is that "
                                  "rank dead or stuck? (set DPLAB_TIMEOUT to wait longer)")

    def _peek(self, peer: int) -> None:
        """``peer`` has not taken this collective's message (or, ANY_SOURCE, a peer has not joined
        the native all-reduce's check): a message of another collective waiting for us means its
        sender is in that one (it cannot have finished ours): say so now."""
        status = self.MPI.Status()
        if self._comm.Iprobe(self.MPI.ANY_SOURCE if peer == ANY_SOURCE else peer, self.MPI.ANY_TAG,
                             status):
            theirs = status.Get_tag() >> _TAG_BITS
            if theirs != self._tag and theirs >= COLLECTIVE_TAG:
                raise collective_mismatch(self.rank, self._tag, status.Get_source(), theirs)

    def _abandon(self, req: Any) -> None:
        try:
            req.Cancel()
            if req.Test():
                return
        except self.MPI.Exception:  # collectives cannot be cancelled
            pass
        self._abandoned.append(req)  # it holds its buffer: MPI may still write into it

    # -- point to point -----------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dst: int, tag: int = 0) -> _Request:
        return _Request(self, self._post_send(buf, dst, tag), buf, dst, None)

    def irecv(self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = 0) -> _Request:
        if tag != ANY_TAG:
            self._mpi_tag(tag)
        return _Request(self, self._post_recv(buf, src), buf, src, tag)

    def _post_send(self, buf: np.ndarray, dst: int, tag: int) -> Any:
        self._check_peer(dst)
        code = _CODE.get(buf.dtype)
        if code is None or not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: send needs a contiguous array of one of "
                            f"{', '.join(map(str, _CODE))}; got {buf.dtype}, "
                            f"contiguous={buf.flags.c_contiguous}")
        return self._comm.Isend([buf, self.MPI.BYTE], dst, self._mpi_tag(tag) | code)

    def _post_recv(self, buf: np.ndarray, src: int) -> Any:
        self._check_peer(src, any_ok=True)
        if not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: recv needs a contiguous array: receive into "
                            "np.empty and copy, or pass a contiguous slice")
        source = self.MPI.ANY_SOURCE if src == ANY_SOURCE else src
        return self._comm.Irecv([buf, self.MPI.BYTE], source, self.MPI.ANY_TAG)

    def _complete_recv(self, req: Any, buf: np.ndarray, peer: int, tag: int, what: str = "",
                       peek: int | None = None) -> int:
        """Wait for a receive, check that the message is the one ``buf`` expects; its source."""
        MPI, status = self.MPI, self.MPI.Status()
        try:
            if not req.Test(status):  # (the first test inline: a message that is there costs less)
                self._poll(req, status, what or ("a message from any rank" if peer == ANY_SOURCE
                                                 else "rank {peer}'s message"), peer, peek)
        except MPI.Exception as e:
            if e.Get_error_class() != MPI.ERR_TRUNCATE:
                raise CommError(f"rank {self.rank}: receive from rank {peer} failed: {e}") from e
            src, mtag = status.Get_source(), status.Get_tag()
            self._check_collective(tag, src, mtag >> _TAG_BITS)
            dtype = _DTYPES[mtag & 15]
            raise self._mismatch(buf, src,
                                 f"more than {buf.nbytes // dtype.itemsize} x {dtype}") from None
        src, mtag = status.Get_source(), status.Get_tag()
        theirs = mtag >> _TAG_BITS
        if theirs != tag:
            self._check_collective(tag, src, theirs)
        dtype, nbytes = _DTYPES[mtag & 15], status.Get_count(MPI.BYTE)
        if nbytes != buf.nbytes or dtype != buf.dtype:
            raise self._mismatch(buf, src, f"{nbytes // dtype.itemsize} x {dtype}")
        if tag != ANY_TAG and theirs != tag:
            raise CommError(f"rank {self.rank} expected tag {tag} from rank {src}, got tag "
                            f"{theirs}: messages between two ranks are matched in order")
        return src

    def _check_collective(self, tag: int, src: int, theirs: int) -> None:
        if theirs != tag and tag != ANY_TAG and max(tag, theirs) >= COLLECTIVE_TAG:
            raise collective_mismatch(self.rank, tag, src, theirs)

    def _mismatch(self, buf: np.ndarray, src: int, sent: str) -> BufferMismatch:
        return BufferMismatch(
            f"rank {self.rank} expected {buf.size} x {buf.dtype} from rank {src} but rank "
            f"{src} sent {sent}: every rank must pass a buffer of the same length and dtype to "
            "a collective")

    def _mpi_tag(self, tag: int) -> int:
        if not 0 <= tag <= self._max_tag:
            raise CommError(f"rank {self.rank}: tag {tag} out of range: use 0..{self._max_tag}")
        return tag << _TAG_BITS

    def _check_peer(self, peer: int, any_ok: bool = False) -> None:
        if (not (0 <= peer < self.world_size and peer != self.rank)
                and not (any_ok and peer == ANY_SOURCE)):
            raise CommError(f"rank {self.rank}: peer {peer} is not another rank of a world of "
                            f"size {self.world_size}")

    # -- rounds and collectives ---------------------------------------------------------------
    def check_buffer(self, buf: np.ndarray, call: Collective | None = None) -> None:
        """The collective's messages carry its code in their tag (length
        and dtype they carry anyway)."""
        self._tag = call.code() if call is not None else 0

    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """Post every receive, then every send; complete receives in order, adding reduce ones.
        (Receives are not posted a round early, as the torch backend does: on MPI that is slower,
        see backends/PERFORMANCE.md.)"""
        tr, tag = self.tracer, self._tag if round >= 0 else 0
        traced = tr.enabled  # the hot path builds no events and reads no clocks
        into = self._landing(recvs)
        rreqs = [self._post_recv(b, r.peer) for b, r in zip(into, recvs)]
        t_post = tr.now() if traced else 0
        sreqs = [self._post_send(s.buf, s.peer, tag) for s in sends]
        for req, r, b in zip(rreqs, recvs, into):
            t0 = tr.now() if traced else 0
            self._complete_recv(req, b, r.peer, tag)
            if r.reduce:
                np.add(r.buf, b, out=r.buf)
            elif b is not r.buf:
                np.copyto(r.buf, b)
            if traced:
                tr.record("reduce" if r.reduce else "copy", t0, tr.now(), peer=r.peer,
                          bytes=r.buf.nbytes, chunk=r.chunk, round=round, algorithm=algorithm)
        for req, s in zip(sreqs, sends):
            self._poll(req, None, _TO_TAKE, s.peer, s.peer if tag >= COLLECTIVE_TAG else None)
            if traced:
                tr.record("send", t_post, tr.now(), peer=s.peer, bytes=s.buf.nbytes, chunk=s.chunk,
                          round=round, algorithm=algorithm)

    def _landing(self, recvs: list[RecvSpec]) -> list[np.ndarray]:
        """Where each receive lands: reduce (or strided) ones in this thread's reused arena."""
        sizes = [-(-r.buf.nbytes // _ALIGN) * _ALIGN if r.reduce or not r.buf.flags.c_contiguous
                 else 0 for r in recvs]
        if not any(sizes):
            return [r.buf for r in recvs]
        arena = getattr(self._local, "arena", None)
        if arena is None or arena.nbytes < sum(sizes):  # grow by doubling: a few sizes, then none
            arena = self._local.arena = np.empty(max(sum(sizes), 2 * getattr(arena, "nbytes", 0)),
                                                 np.uint8)
        into, off = [], 0
        for r, size in zip(recvs, sizes):
            into.append(arena[off:off + r.buf.nbytes].view(r.buf.dtype).reshape(r.buf.shape)
                        if size else r.buf)
            off += size
        return into

    def close(self) -> None:
        if self._comm != self.MPI.COMM_NULL:
            for reqs, *_ in self._agreement or ():  # inactive: the check completed
                for req in reqs:
                    req.Free()
            self._agreement = None
            self._comm.Free()

    # -- what MPI's own collectives do: barrier, the native all-reduce, the control path ---------
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
            raise ConfigError(f"rank {self.rank}: this MPI has no float16 reduction "
                              "(MPI_FLOAT16_T, MPICH 4.2+): use algorithm ring, tree, naive or "
                              "direct for float16")
        if mpi_type is None or not buf.flags.c_contiguous:
            raise CommError(f"rank {self.rank}: the native all-reduce needs a contiguous "
                            f"{', '.join(map(str, self._types))} array; got {buf.dtype}")
        if check and self.world_size > 1:
            self._agree(buf)
            # MPI_Allreduce of nothing returns at once, synchronising no one: a rank out early
            # would reach a peer still in _agree, which reads its next collective's message as a
            # mismatch
            if buf.size == 0:
                self.barrier()
                return
        self._comm.Allreduce(MPI.IN_PLACE, [buf, mpi_type], op=MPI.SUM)
        if op == "mean":
            buf /= self.world_size

    def _agree(self, buf: np.ndarray) -> None:
        """Raise ``BufferMismatch`` on every rank unless every rank passed this length and dtype.

        Dissemination, by point-to-point messages: in round k = 0, 1, ... rank r sends the max of
        (n, dtype, -n, -dtype) it has seen to r + 2^k and takes the max with what r - 2^k sends;
        after ceil(log2 p) rounds every rank holds the max over all ranks, and max == -min for n and
        dtype only where every rank agrees. Why not ``MPI_Iallreduce`` of the same 4 integers:
        MPICH's non-blocking schedule costs more than these messages (backends/PERFORMANCE.md). The
        messages carry the native all-reduce's code in their tag, so a peer in another collective is
        a ``CollectiveMismatch`` at the first message, either way round."""
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
                f"rank {self.rank} passed {n} x {buf.dtype} to the native all-reduce but "
                f"other ranks passed between {-hi[2]} and {hi[0]} elements or another dtype: "
                "every rank must pass a buffer of the same length and dtype to a collective")

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
        """Stop every rank of the job now (MPI_Abort): one failed rank
        must not leave others waiting."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._comm.Abort(code)
