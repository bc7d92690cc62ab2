"""The Communicator: the minimal transport the reference code is written against.

Every backend (shared memory, MPI, torch.distributed) implements these few
methods; the collectives, the trainers and the parameter server use nothing else.
Data always moves through buffers (numpy arrays, or tensors viewed as arrays),
never through pickle. Every blocking call honours ``timeout`` and raises
``CommTimeout`` naming the peer instead of hanging. What every backend guarantees when
ranks call different collectives or pass different buffers: ``Communicator``'s docstring.

The one composite call is ``exchange``: a round of a schedule posts all its sends
and receives together and then waits for all of them. Posting them together is
what keeps a ring from deadlocking (everyone sends before anyone waits), and it
is the shape NCCL needs (batched point-to-point). The default here is built on
``isend``/``irecv``; a shared-memory backend overrides it to reduce straight out
of the peer's memory.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, NamedTuple, Protocol

import numpy as np

from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.trace import Tracer

__all__ = ["ANY_SOURCE", "Communicator", "Request", "SendSpec", "RecvSpec", "CommError",
           "CommTimeout", "BufferMismatch", "CollectiveMismatch", "PeerLost", "Collective",
           "COLLECTIVE_TAG", "describe_tag", "collective_mismatch", "require_writable"]

ANY_SOURCE = -1
COLLECTIVE_TAG = 1 << 20  # tags from here on name a collective (Collective.code); below, the user's
_KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
_SLOTS = 32  # algorithms a collective code has room for


@cache
def _algorithms() -> tuple[str, ...]:
    """The names a collective code can carry, in the one registry's order (``native`` included):
    every rank imports the same registry, so every rank derives the same codes. Imported on first
    use: the registry loads every algorithm, which a bare communicator does not need."""
    from dplab.reference.algorithms import ALGORITHMS

    if len(ALGORITHMS) > _SLOTS:  # pragma: no cover - a registry this long needs a wider code
        raise ConfigError(f"{len(ALGORITHMS)} algorithms do not fit a collective code's {_SLOTS} "
                          "slots")
    return ALGORITHMS


class CommError(DplabError):
    """A transport failed; the message names the ranks involved."""


class CommTimeout(CommError, TimeoutError):
    """A blocking call waited longer than the communicator's timeout."""


class BufferMismatch(CommError):
    """Two ranks disagree on a message's length or dtype (every rank must pass the same buffer
    shape)."""


class CollectiveMismatch(CommError):
    """Two ranks called different collectives, or one collective with different algorithms or
    roots."""


class PeerLost(CommError):
    """The connection to a peer closed under a call: the peer died or failed first (see its
    error)."""


class Collective(NamedTuple):
    """What a rank called; every rank must call the same. ``code()`` packs it into one integer
    that travels with the collective's messages (their tag on shared memory and MPI, the link
    header on gloo), so comparing it costs one integer comparison per message.

    Args:
        kind: "allreduce", "reduce_scatter", "allgather", "broadcast" or "reduce".
        algorithm: the algorithm's name.
        root: the root of a broadcast or reduce (-1: none).
    """

    kind: str  # allreduce, reduce_scatter, allgather, broadcast, reduce
    algorithm: str
    root: int = -1  # rooted collectives (broadcast, reduce) only

    def code(self) -> int:
        """This call as one integer: the tag its messages carry.

        Returns:
            ``COLLECTIVE_TAG`` plus the kind, the algorithm's index and the root, packed.

        Raises:
            ConfigError: an unknown kind or algorithm.
        """
        name, names = self.algorithm.partition(":")[0], _algorithms()
        if self.kind not in _KINDS or name not in names:
            raise ConfigError(f"no collective code for {self}: the kind is one of "
                              f"{', '.join(_KINDS)} and the algorithm one of {', '.join(names)}")
        k, a = _KINDS.index(self.kind), names.index(name)
        return COLLECTIVE_TAG + k + 8 * (a + _SLOTS * (self.root + 1))

    @classmethod
    def decode(cls, code: int) -> Collective | None:
        """The collective a code names, or None (a user's tag, or a bare exchange's 0).

        Args:
            code: a message's tag.

        Returns:
            The collective, or None.
        """
        if code < COLLECTIVE_TAG:
            return None
        k, rest = (code - COLLECTIVE_TAG) % 8, (code - COLLECTIVE_TAG) // 8
        names = _algorithms()
        if k >= len(_KINDS) or rest % _SLOTS >= len(names):
            return None
        return cls(_KINDS[k], names[rest % _SLOTS], rest // _SLOTS - 1)

    def __str__(self) -> str:
        return f"{self.kind}({self.algorithm}{'' if self.root < 0 else f', root={self.root}'})"


def describe_tag(tag: int) -> str:
    """A message's tag in words: the collective it belongs to, or a point-to-point tag.

    Args:
        tag: a message's tag.

    Returns:
        E.g. "allreduce(ring)", or "a point-to-point message or exchange (tag 5)".
    """
    call = Collective.decode(tag)
    return str(call) if call is not None else f"a point-to-point message or exchange (tag {tag})"


def collective_mismatch(rank: int, mine: int, peer: int, theirs: int) -> CollectiveMismatch:
    """The error for a message of another collective than the one ``rank`` is in.

    Args:
        rank: the rank that noticed.
        mine: the tag of the collective it is in.
        peer: the rank the message came from.
        theirs: the tag the message carried.

    Returns:
        The error, naming both ranks and both calls (the caller raises it).
    """
    return CollectiveMismatch(
        f"rank {rank} called {describe_tag(mine)} but rank {peer} called {describe_tag(theirs)}: "
        "every rank must call the same collective with the same algorithm (and root), in the same "
        "order")


def require_writable(buf: object) -> None:
    """Collectives write their result into ``buf``: refuse a read-only array before any message.

    Args:
        buf: the caller's buffer (anything without numpy's ``flags`` passes).

    Raises:
        ConfigError: ``buf`` is a read-only array.
    """
    flags = getattr(buf, "flags", None)
    if flags is not None and not flags.writeable:
        raise ConfigError("collectives write their result into the buffer, but this array is "
                          "read-only (e.g. np.frombuffer over bytes): pass a writable array, e.g. "
                          "buf.copy()")


class Request(Protocol):
    """A posted ``isend`` or ``irecv``: ``wait()`` completes it."""

    def wait(self) -> int | None:
        """Block until the transfer is done.

        Returns:
            The source rank for a receive (None where the backend cannot tell); None for a send.

        Raises:
            CommTimeout: it did not complete within the communicator's timeout.
            PeerLost: the peer's connection closed under the call.
        """


class SendSpec(NamedTuple):
    """One send of an ``exchange``.

    Args:
        buf: what to send.
        peer: the receiving rank.
        chunk: the schedule's chunk it carries, for the trace (-1: none).
    """

    buf: np.ndarray
    peer: int
    chunk: int = -1


class RecvSpec(NamedTuple):
    """One receive of an ``exchange``.

    Args:
        buf: where it lands.
        peer: the sending rank.
        chunk: the schedule's chunk it carries, for the trace (-1: none).
        reduce: add into ``buf`` instead of overwriting it.
    """

    buf: np.ndarray
    peer: int
    chunk: int = -1
    reduce: bool = False  # add into buf instead of overwriting it


class Communicator(ABC):
    """One rank's transport. The mismatch contract, which every backend meets (its module
    docstring says how) and ``tests/test_comm_mismatch.py`` checks on each:

    Every rank must call the same collectives, in the same order, each with the same kind,
    algorithm, root, buffer length and dtype. Each collective announces itself first with
    ``check_buffer(buf, call)``; ``call.code()`` is the integer its messages carry.

    1. Another call: a rank that receives a message of a collective whose kind, algorithm or
       root differs from its own raises ``CollectiveMismatch`` at that message, naming both
       ranks and both calls ("rank 0 called allreduce(ring) but rank 1 called allreduce(tree)").
    2. Another buffer: a rank that receives a message of its own collective with another
       length or dtype raises ``BufferMismatch`` naming both ranks and both lengths and dtypes.
       ``native_allreduce(check=True)`` raises it on every rank before the engine sums anything.
    3. No message to compare (a rank that only sends, or waits inside the engine's own
       collective): ``CollectiveMismatch`` where the backend can look at the peer's waiting
       message, else ``CommTimeout`` naming the peer and what it waited for, after ``timeout``.
       Never a hang, never a result summed from mismatched buffers.
    4. Everyone else: the launcher stops the other ranks and reports the first failure with
       its traceback; a rank that meets a connection closed by a failed peer raises ``PeerLost``.

    After any of these errors the buffer's contents are unspecified.
    """

    rank: int
    world_size: int
    timeout: float
    tracer: Tracer
    # the transport, as --backend names it ("local", "mpi", "torch"): checkpoints record it
    backend: str = ""
    # torch tensors travel as they are (torch, cuda); else numpy arrays only
    moves_tensors: bool = False
    # tensors in host memory travel as tensors too (torch, gloo): bfloat16 too
    host_tensors: bool = False
    simulated: bool = False  # time is a simulated cluster's (the sim backend's), not the wall's
    _hosts: tuple[int, ...] | None = None  # set by a backend at connect time (the ``hosts`` setter)
    # the torch device this rank's buffers live on, as its launcher placed it (the cuda backend's
    # GPU, the torch backend's --device); None: host memory
    device: Any = None

    @property
    def compute_device(self) -> Any:
        """Where a trainer on this rank computes unless its caller says otherwise (``train_sync``).

        Returns:
            ``device`` if it is a CUDA GPU (torch tensors there); None otherwise: NumPy arrays on
            the host (the local and MPI transports, and the cuda and torch ones on the CPU).
        """
        device = getattr(self, "device", None)  # any object with a device: compute_device's callers
        return device if getattr(device, "type", None) == "cuda" else None

    @property
    def hosts(self) -> tuple[int, ...]:
        """Each rank's host index, the same tuple on every rank: ``(0, 0, 1, 1)`` is 2 hosts x 2
        ranks, hosts numbered in the order of their first rank. Which ranks share a host comes from
        the launcher (torchrun's LOCAL_WORLD_SIZE, MPI's shared-memory split, Slurm's tasks per
        node); the default, every rank on one host, is dplab's own launch. ``hierarchical`` and
        ``auto`` read it (``dplab.reference.algorithms.layout``)."""
        return self._hosts if self._hosts is not None else (0,) * self.world_size

    @hosts.setter
    def hosts(self, value: tuple[int, ...]) -> None:
        """Any per-rank host keys (a node id, a host's first rank);
        renumbered from 0 in rank order."""
        order: dict[int, int] = {}
        value = tuple(order.setdefault(int(h), len(order)) for h in value)
        if len(value) != self.world_size:
            raise ConfigError(f"hosts names {len(value)} ranks' hosts, the world has "
                              f"{self.world_size}")
        self._hosts = value

    @abstractmethod
    def isend(self, buf: np.ndarray, dst: int, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``dst``; ``buf`` must stay untouched until ``wait()``.

        Args:
            buf: a contiguous array (or tensor, where ``moves_tensors``).
            dst: the receiving rank.
            tag: told apart from other messages between the same ranks (a collective's code).

        Returns:
            The request to wait on.
        """

    @abstractmethod
    def irecv(self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = 0) -> Request:
        """The request's ``wait()`` returns the source rank (useful with ANY_SOURCE).

        Args:
            buf: where the message lands (its length and dtype must match the sender's).
            src: the sending rank, or ``ANY_SOURCE``.
            tag: as the sender's ``isend``.

        Returns:
            The request to wait on.
        """

    @abstractmethod
    def native_allreduce(self, buf: np.ndarray, op: str = "sum", check: bool = True) -> None:
        """The engine's own all-reduce, in place: the yardstick for ours. ``check=False`` skips
        the shape check that an engine which cannot catch mismatched buffers needs first (the
        benchmark times the engine as its users call it).

        Args:
            buf: a contiguous array (or tensor), summed in place.
            op: "sum" (the only op the executor asks for).
            check: compare every rank's length and dtype first.

        Raises:
            BufferMismatch: ranks passed different lengths or dtypes (``check=True``).
            CommTimeout: a peer did not take part in time.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the transport (segments, sockets, process groups); the last call on it."""

    def peer_alive(self, rank: int) -> bool:
        """Has ``rank`` not died? Optional: the shared-memory backend can tell (the peer's pid).

        The default cannot tell and says True. MPI aborts the whole job when a rank dies,
        so there is nobody left to ask; gloo/NCCL report a broken connection as an error
        of the call that used it.

        Args:
            rank: the peer.

        Returns:
            False only when the backend knows the peer died.
        """
        return True

    def now(self) -> float:
        """Seconds on this rank's clock: the wall's (``time.perf_counter``); the sim backend's
        virtual clock there (``simulated``).

        Returns:
            Seconds, as a float.
        """
        return time.perf_counter()

    def compute(self, ops: Iterable[tuple[float, float]], dtype: str = "float64") -> float:
        """Operations [(flops, bytes), ...] this rank just computed: nothing to do here (they took
        the time they took); the sim backend spends their modelled time on its virtual clock
        (``dplab.reference.flops`` says what the reference MLP's cost). Returns the seconds
        charged.

        Args:
            ops: (flops, bytes) per operation.
            dtype: the dtype they computed in.

        Returns:
            Seconds charged to this rank's clock: 0 here.
        """
        return 0.0

    @contextmanager
    def job(self) -> Iterator[None]:
        """Around each job a launcher runs on this rank (``launch``, ``World.run``): nothing here;
        the sim backend's ranks enter virtual time and leave it."""
        yield

    @contextmanager
    def patience(self, seconds: float) -> Iterator[None]:
        """Blocking calls inside give up after ``seconds`` (``CommTimeout``) instead of ``timeout``,
        so the caller can check ``peer_alive`` and try again. Only where a timed-out call leaves
        no half-matched message behind (shared memory); the default changes nothing.

        Args:
            seconds: the timeout inside the block.
        """
        yield

    def check_buffer(self, buf: np.ndarray, call: Collective | None = None) -> None:
        """Called by every hand-written collective with the whole (flat) buffer, before round 0;
        the rounds that follow (``exchange`` with ``round >= 0``) belong to ``call``. A backend
        records what its messages must carry to meet the mismatch contract (the class docstring).
        The default does nothing: a backend that keeps it meets only the timeout clause.

        Args:
            buf: the collective's whole flat buffer.
            call: the collective (None: a bare exchange).
        """
        return None

    def send(self, buf: np.ndarray, dst: int, tag: int = 0) -> None:
        """Send ``buf`` to ``dst`` and wait until it is out (``isend`` then ``wait``).

        Args:
            buf: a contiguous array (or tensor, where ``moves_tensors``).
            dst: the receiving rank.
            tag: as ``isend``'s.

        Raises:
            CommTimeout: the send did not complete within ``timeout``.
            PeerLost: the peer's connection closed under the call.
        """
        self.isend(buf, dst, tag).wait()

    def recv(self, buf: np.ndarray, src: int = ANY_SOURCE, tag: int = 0) -> int:
        """Receive into ``buf`` from ``src`` and wait for it (``irecv`` then ``wait``).

        Args:
            buf: where the message lands.
            src: the sending rank, or ``ANY_SOURCE``.
            tag: as the sender's.

        Returns:
            The rank the message came from.

        Raises:
            CommTimeout: nothing came within ``timeout``.
            BufferMismatch: the message's length or dtype differs from ``buf``'s.
            CollectiveMismatch: the message belongs to another collective.
            PeerLost: the peer's connection closed under the call.
        """
        source = self.irecv(buf, src, tag).wait()
        return src if source is None else source

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        """A buffer the transport can move fastest (shared memory registers it; others use
        numpy).

        Args:
            shape: the array's shape.
            dtype: its dtype.

        Returns:
            An uninitialised array.
        """
        return np.empty(shape, dtype=dtype)

    def barrier(self) -> None:
        """Dissemination barrier: in round k, rank r signals r + 2^k and waits for r - 2^k.

        Raises:
            CommTimeout: a peer did not arrive within ``timeout``.
        """
        token = np.zeros(0, dtype=np.uint8)
        step = 1
        while step < self.world_size:
            req = self.isend(token, (self.rank + step) % self.world_size, tag=-2)
            self.recv(token, (self.rank - step) % self.world_size, tag=-2)
            req.wait()
            step *= 2

    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """One round: post every receive and send, then complete them; reduces apply in list order.
        ``round`` >= 0: round of the collective begun by the last ``check_buffer``; -1:
        on its own.

        Args:
            sends: what to send, and to whom.
            recvs: where to receive, from whom, and whether to add.
            round: the round of the current collective, or -1.
            algorithm: the schedule's name, for the trace.

        Raises:
            CommTimeout: a transfer did not complete within ``timeout``.
            BufferMismatch: a message's length or dtype differs from its receive buffer's.
            CollectiveMismatch: a message belongs to another collective.
            PeerLost: a peer's connection closed under the call.
        """
        scratch = [np.empty_like(r.buf) if r.reduce else r.buf for r in recvs]
        rreqs = [self.irecv(s, r.peer) for s, r in zip(scratch, recvs)]
        sreqs = [self.isend(s.buf, s.peer) for s in sends]
        for req, spec, tmp in zip(rreqs, recvs, scratch):
            t0 = self.tracer.now()
            req.wait()
            if spec.reduce:
                np.add(spec.buf, tmp, out=spec.buf)
            self.tracer.record("reduce" if spec.reduce else "copy", t0, self.tracer.now(),
                               peer=spec.peer, bytes=spec.buf.nbytes, chunk=spec.chunk,
                               round=round, algorithm=algorithm)
        for req, spec in zip(sreqs, sends):
            t0 = self.tracer.now()
            req.wait()
            self.tracer.record("send", t0, self.tracer.now(), peer=spec.peer,
                               bytes=spec.buf.nbytes, chunk=spec.chunk, round=round,
                               algorithm=algorithm)
