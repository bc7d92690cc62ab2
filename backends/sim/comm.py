"""SimComm: one rank of a simulated cluster, the ``Communicator`` every backend speaks.

The rank runs the real code on real data (numpy arrays or torch tensors on the host); what its
calls cost comes from the cluster's model, on the rank's virtual clock (``comm.now()``):

    exchange(sends, recvs)   every send and receive posted at once; resumes when all are done, then
                             applies the receives in list order (bitwise the local backend's sums)
                             and charges gamma per reduced byte on the rank's device
    compute(ops, dtype)      operations [(flops, bytes)], each at the roofline: max(flops / rate,
                             bytes / memory bandwidth, the device's least time per operation)
    sleep(seconds)           time spent holding nothing (time.sleep does the same on a rank)

``native_allreduce`` is the local backend's one-shot (rank d sums chunk d of every rank, in the
order d, d+1, ..., d-1, and sends it back), so its bits are those of local and cuda. Mismatch
contract: messages carry their collective's code and buffer facts, checked when a send meets its
receive (1, 2); a world where every rank waits with nothing under way is a deadlock, reported at
once to every waiting rank (3), and a rank waiting for one that failed gets ``PeerLost`` (4).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from dplab.backends.sim.engine import Actor
from dplab.backends.sim.network import EXCHANGE_TAG, Post
from dplab.reference.communicator import (
    ANY_SOURCE,
    Collective,
    Communicator,
    RecvSpec,
    SendSpec,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds
from dplab.reference.trace import Tracer

__all__ = ["SimComm", "SimTracer"]

_NATIVE = Collective("allreduce", "native")


class SimTracer(Tracer):
    """A tracer on the virtual clock (``time.perf_counter_ns`` reads it in a rank's threads); a
    rank's main thread is "main", any thread it started is "comm"."""

    def __init__(self, rank: int, comm: SimComm) -> None:
        super().__init__(rank)
        self._comm = comm

    def record(self, kind: str, t_start_ns: int, t_end_ns: int, **fields: Any) -> None:
        if self.enabled:
            if "thread" not in fields:
                actor = self._comm.world.engine.current()
                fields["thread"] = "main" if actor is None or actor.main else "comm"
            self.events.append(_event(self.rank, kind, t_start_ns, t_end_ns, fields))


def _event(rank: int, kind: str, t0: int, t1: int, fields: dict[str, Any]) -> Any:
    from dplab.reference.trace import Event

    return Event(rank, kind, t0, t1, **fields)


class _Request:
    def __init__(self, comm: SimComm, post: Post) -> None:
        self.comm, self.post = comm, post

    def wait(self) -> int | None:
        comm, post = self.comm, self.post
        if not post.done:
            comm.world.network.wait(comm._ready(), [post], _what(post))
        elif post.error is not None:
            raise post.error
        if not post.send:
            comm._trace_post("copy", post, -1, "")
            return post.source
        comm._trace_post("send", post, -1, "")
        return None


class SimComm(Communicator):
    """Rank ``rank`` of ``world`` (``dplab.backends.sim.setup.SimWorld``)."""

    backend, moves_tensors, simulated = "sim", True, True

    def __init__(self, world: Any, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self.timeout = world.timeout
        self.cluster = world.cluster
        self.tracer = SimTracer(rank, self)
        self.actor: Actor = world.engine.actors[(rank, 0)]
        self.hosts = tuple(world.cluster.node_of(r) for r in range(world.world_size))
        self._code, self._facts, self._buffer = 0, None, 0
        self._clock = None  # the torch FLOP clock of this rank's main thread, once torch is in use
        if "torch" in sys.modules:  # backward runs in the rank's own thread (see backends/cuda)
            sys.modules["torch"].autograd.set_multithreading_enabled(False)

    @property
    def topology(self) -> Any:
        """The cluster as the cost model sees it (``auto`` prices schedules on it)."""
        return self.world.topology

    # -- time --------------------------------------------------------------------------------------
    def now(self) -> float:
        """This rank's virtual time, seconds since the world started (its compute so far spent)."""
        actor = self.world.engine.current()
        if actor is None:
            return self.actor.time
        self.world.engine.settle(actor)  # its compute so far, queued on its device, is spent
        return actor.time

    def compute(self, ops: Iterable[tuple[float, float]], dtype: str = "float64") -> float:
        """Spend the time ``ops`` [(flops, bytes), ...] take on this rank's device, each at the
        roofline (the slower of its FLOPs at the device's rate for ``dtype`` and its bytes at the
        memory bandwidth, and at least the device's least time per operation); returns the
        seconds."""
        return self.world.spend(self._me(), self.rank, ops, dtype)

    def work(self, seconds: float) -> None:
        """Keep this rank's device busy for ``seconds``, queued behind whatever it is doing (spent
        at the rank's next message, wait or clock read: ``Engine.owe``)."""
        if seconds > 0:
            self.world.engine.owe(self._me(), seconds, self.world.devices[self.rank])

    def synchronize(self) -> None:
        """Wait until this rank's device has done what was queued on it (as torch.cuda.synchronize):
        where ranks are threads of one process, the device runs behind the host."""
        me, engine = self._ready(), self.world.engine
        engine.hold(me, [(self.world.devices[self.rank], 0.0)])

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass, holding nothing."""
        self.world.engine.advance(self._me(), seconds)

    @contextmanager
    def job(self) -> Iterator[None]:
        """Around each job the launcher runs on this rank: enter virtual time, leave it after."""
        engine = self.world.engine
        engine.enter(self.actor)
        error = None
        try:
            self._start_clock()
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            self._stop_clock()
            engine.leave(self.actor, error)

    def _start_clock(self) -> None:
        """Price this thread's torch operations from now on, once torch is loaded."""
        if self._clock is None and "torch" in sys.modules:
            from dplab.backends.sim.compute import TorchClock

            sys.modules["torch"].autograd.set_multithreading_enabled(False)
            self._clock = TorchClock(self)
            self._clock.__enter__()

    def _stop_clock(self) -> None:
        if self._clock is not None:
            clock, self._clock = self._clock, None
            clock.__exit__(None, None, None)

    def _me(self) -> Actor:
        actor = self.world.engine.current()
        if actor is None:
            self.world.engine._check()
            raise ConfigError(
                "a sim rank's communicator is used outside its job's threads: call it from "
                "the function launch() runs, or a thread that function started"
            )
        self.world.engine.contact(actor)  # torch imported during this job: charge its ops from now
        return actor

    def _ready(self) -> Actor:
        """The calling actor with its compute spent: what every message and wait starts from."""
        actor = self._me()
        self.world.engine.settle(actor)
        return actor

    # -- collectives ------------------------------------------------------------------------------
    def check_buffer(self, buf: Any, call: Collective | None = None) -> None:
        self._code = 0 if call is None else call.code()
        self._facts = _facts(buf)
        self._buffer = _nbytes(buf)  # what the collective's copies work on (the link's cache)

    def exchange(
        self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1, algorithm: str = ""
    ) -> None:
        """One round: post everything, wait for all of it, apply the receives in list order, then
        spend gamma per reduced byte on the device.

        Args:
            sends: what this rank sends (buffer, peer, chunk).
            recvs: what it receives (buffer, peer, chunk, reduce: add into the buffer or copy).
            round: the schedule's round (-1 outside a collective: no buffer facts checked).
            algorithm: the schedule's name, which picks the link's terms for its messages.

        Raises:
            CollectiveMismatch, BufferMismatch: a peer called another collective, or passed
                another buffer; Deadlock: every rank waits and nothing is under way.
        """
        me, net = self._ready(), self.world.network
        code, facts = (self._code, self._facts) if round >= 0 else (0, None)
        buffer = self._buffer if round >= 0 else 0
        t = me.time
        out = [
            net.send(self.rank, s.peer, EXCHANGE_TAG, s.buf, _nbytes(s.buf), t, code, facts,
                     algorithm, buffer)
            for s in sends
        ]
        into = [
            net.recv(self.rank, r.peer, EXCHANGE_TAG, r.buf, _nbytes(r.buf), t, code, facts,
                     algorithm)
            for r in recvs
        ]
        net.wait(me, out + into, f"round {round} of {algorithm or 'an exchange'}")
        reduced = 0
        for spec, post in zip(recvs, into):
            if spec.reduce:
                _add(spec.buf, post.data)
                reduced += post.nbytes
            else:
                _assign(spec.buf, post.data)
            post.data = None
        if reduced:  # gamma per reduced byte, on the device before this rank's next step
            self.world.reduced(me, self.rank, reduced, algorithm)
        if self.tracer.enabled:
            for spec, post in zip(recvs, into):
                self._trace_post(
                    "reduce" if spec.reduce else "copy", post, round, algorithm, spec.chunk
                )
            for spec, post in zip(sends, out):
                self._trace_post("send", post, round, algorithm, spec.chunk)

    def native_allreduce(self, buf: Any, op: str = "sum", check: bool = True) -> None:
        """The one-shot: rank d sums chunk d of every buffer (order d, d+1, ..., d-1), then sends it
        to every rank; timed as the two rounds of messages it is."""
        if op != "sum":
            raise ConfigError(f"native_allreduce sums; got op={op!r}")
        flat = buf.reshape(-1) if isinstance(buf, np.ndarray) else buf.view(-1)
        require_writable(flat)
        p, me = self.world_size, self.rank
        if p == 1:
            return
        self.check_buffer(flat, _NATIVE) if check else self.check_buffer(flat, None)
        bounds = chunk_bounds(len(flat), p)
        part = lambda d: flat[bounds[d][0] : bounds[d][1]]  # noqa: E731
        order = [(me + i) % p for i in range(1, p)]  # d + 1, ..., d - 1
        self.exchange(
            [SendSpec(part(d), d, d) for d in order],
            [RecvSpec(part(me), s, me, True) for s in order],
            round=0,
            algorithm="native",
        )
        self.exchange(
            [SendSpec(part(me), d, me) for d in order],
            [RecvSpec(part(s), s, s) for s in order],
            round=1,
            algorithm="native",
        )

    # -- point to point ---------------------------------------------------------------------------
    def isend(self, buf: Any, dst: int, tag: int = 0) -> _Request:
        me = self._ready()
        self._check_peer(dst)
        return _Request(
            self, self.world.network.send(self.rank, dst, tag, buf, _nbytes(buf), me.time)
        )

    def irecv(self, buf: Any, src: int = ANY_SOURCE, tag: int = 0) -> _Request:
        me = self._ready()
        if src != ANY_SOURCE:
            self._check_peer(src)
        return _Request(
            self, self.world.network.recv(self.rank, src, tag, buf, _nbytes(buf), me.time)
        )

    def close(self) -> None:
        self._stop_clock()

    def _check_peer(self, peer: int) -> None:
        if not (type(peer) is int or hasattr(peer, "__index__")) or not 0 <= peer < self.world_size:
            raise ConfigError(f"rank {peer} is not a rank of a world of size {self.world_size}")

    def _trace_post(
        self, kind: str, post: Post, round: int, algorithm: str, chunk: int = -1
    ) -> None:
        if self.tracer.enabled and post.start >= 0:
            self.tracer.record(
                kind,
                round_ns(post.start),
                round_ns(post.end),
                peer=post.source,
                bytes=post.nbytes,
                chunk=chunk,
                round=round,
                algorithm=algorithm,
            )


def round_ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _what(post: Post) -> str:
    peer = "any rank" if post.peer == ANY_SOURCE else f"rank {post.peer}"
    return f"{'its send to' if post.send else 'a message from'} {peer} (tag {post.tag})"


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else buf.numel() * buf.element_size()


def _facts(buf: Any) -> tuple[int, str]:
    return len(buf), str(buf.dtype).removeprefix("torch.")


def _assign(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
        return
    _torch_op(dst, src, add=False)


def _add(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.add(dst, src, out=dst)
        return
    _torch_op(dst, src, add=True)


def _torch_op(dst: Any, src: Any, add: bool) -> None:
    import torch

    from dplab.backends.sim.compute import uncharged

    d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with uncharged():  # the transfer and gamma price this, not the rank's compute
        d.add_(s) if add else d.copy_(s)
