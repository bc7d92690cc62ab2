"""Messages on a simulated cluster: sends meet receives, and a transfer holds the ports it crosses.

A send and a receive meet by (source, destination, tag), first posted first (MPI's
non-overtaking rule); a receive from ANY_SOURCE takes the earliest send waiting for it. A transfer
starts only when both sides have posted (a rendezvous, as NCCL's kernels and MPI's large-message
protocol need) and its ports are free. A message of m bytes over a link (``cluster.link``) holds the
sender's tx port and the receiver's rx port of that link for alpha + m beta, both at once (a
stream: nothing is buffered in the network); a link ``on_device`` holds the receiving rank's device
instead (a copy on shared memory or on one GPU, which queues with that device's compute), at the
link's beta while the collective's buffers on the node fit its cache and at ``past_cache_beta``
once they do not (``Link.beta_at``: the copies then run from memory); while a world's ranks on a
node outnumber its devices, at an algorithm's ``crowded`` alpha where the link names one.

Queue, not share. Messages that want one port wait their turn (``engine``: first eligible first,
then by rank distance), each at the port's full bandwidth. That is the cost model's per-port sum
(alpha + m beta per message, for the larger of what a rank sends and receives), so on a cluster
without contention the two agree exactly (tests/test_sim_closed_form.py). Sharing the bandwidth
among the messages in flight (max-min fairness) would give the same finishing time for the last of
them but finish the first ones later, and it would pay each message's alpha at once instead of one
after another: the cost model's (p - 1) alpha of a direct all-reduce would become one alpha.

The bytes: a send's data is copied when its transfer ends (the sender may change its buffer once
its send is done); a plain receive lands in its buffer then, an exchange's receives are applied by
the receiver in its own list order when its round is complete (``comm.py``), so the sums are
bitwise those of the local backend. Timing-only posts carry a byte count and no data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from dplab.backends.sim.engine import Actor, Engine, Resource, Task
from dplab.reference.cluster import Cluster
from dplab.reference.communicator import (
    ANY_SOURCE,
    COLLECTIVE_TAG,
    BufferMismatch,
    collective_mismatch,
)

__all__ = ["Post", "Network", "EXCHANGE_TAG"]

EXCHANGE_TAG = (
    -3
)  # the messages of ``exchange`` (a schedule's rounds); user tags are >= 0, barrier -2


class Post:
    """One side of a message: a send (``buf`` read when the transfer ends) or a receive."""

    __slots__ = (
        "rank",
        "peer",
        "tag",
        "buf",
        "nbytes",
        "facts",
        "code",
        "t",
        "done",
        "actor",
        "other",
        "data",
        "start",
        "end",
        "error",
        "send",
        "algorithm",
        "footprint",
    )

    def __init__(
        self,
        send: bool,
        rank: int,
        peer: int,
        tag: int,
        buf: Any,
        nbytes: int,
        t: float,
        code: int = 0,
        facts: Any = None,
        algorithm: str = "",
        footprint: int = 0,
    ) -> None:
        self.algorithm, self.footprint = algorithm, footprint
        self.send, self.rank, self.peer, self.tag, self.buf, self.nbytes = (
            send,
            rank,
            peer,
            tag,
            buf,
            nbytes,
        )
        self.t, self.code, self.facts = t, code, facts
        self.done, self.actor, self.other, self.data, self.error = False, None, None, None, None
        self.start = self.end = -1.0

    @property
    def source(self) -> int:
        """The rank that sent what a receive got (its ``peer`` may be ANY_SOURCE)."""
        return self.other.rank if self.other is not None else self.peer


class Network:
    """The links of ``cluster`` between ``world_size`` ranks; ``devices[r]`` is rank r's device."""

    def __init__(self, engine: Engine, cluster: Cluster, world_size: int,
                 devices: list[Resource], hosts: list[Resource] | None = None,
                 host_alpha: list[float] | None = None) -> None:
        """``hosts``: each rank's host, where the ranks are threads of one process (the cluster's
        ``threads``); ``host_alpha``: what a message's alpha costs there (contention included)."""
        self.engine, self.cluster, self.p, self.devices = engine, cluster, world_size, devices
        self.hosts, self.host_alpha = hosts, host_alpha
        self._ports: dict[tuple, Resource] = {}
        self._routes: dict[tuple, tuple] = {}  # (src, dst, algorithm) -> _route's, on first use
        self._sends: dict[tuple[int, int], list[Post]] = {}  # (dst, tag) -> unmatched, oldest first
        self._recvs: dict[tuple[int, int], list[Post]] = {}  # (dst, tag) -> unmatched receives
        self.bytes_moved = 0
        nodes = [cluster.node_of(r) for r in range(world_size)]
        count = Counter(nodes)
        self.node_ranks = [count[n] for n in nodes]  # ranks of this world on r's node

    # -- posting ---------------------------------------------------------------------------------
    def send(
        self,
        rank: int,
        dst: int,
        tag: int,
        buf: Any,
        nbytes: int,
        t: float,
        code: int = 0,
        facts: Any = None,
        algorithm: str = "",
        buffer: int = 0,
    ) -> Post:
        """Post a send; it meets the first matching receive posted (or a later one).

        Args:
            rank: the sender; dst: the receiver; tag: the message's tag.
            buf: the data (read when the transfer ends), or None for a timing-only post.
            nbytes: its size; t: the virtual time it is posted.
            code, facts: its collective's code and (length, dtype), checked against the receive.
            algorithm: the all-reduce it belongs to (the link's terms for it), or "".
            buffer: the bytes of its collective's buffer on each rank (0: a message alone, whose
                buffers are its own bytes at both ends), for the link's cache.

        Returns:
            The ``Post``: ``done`` once its transfer is through.
        """
        footprint = buffer * self.node_ranks[dst] if buffer else 2 * nbytes
        post = Post(True, rank, dst, tag, buf, nbytes, t, code, facts, algorithm, footprint)
        waiting = self._recvs.get((dst, tag), [])
        for i, r in enumerate(waiting):
            if r.peer in (rank, ANY_SOURCE):
                del waiting[i]
                self._meet(post, r, receiver_now=False)
                return post
        self._sends.setdefault((dst, tag), []).append(post)
        return post

    def recv(
        self,
        rank: int,
        src: int,
        tag: int,
        buf: Any,
        nbytes: int,
        t: float,
        code: int = 0,
        facts: Any = None,
        algorithm: str = "",
    ) -> Post:
        """Post a receive from ``src`` (or ANY_SOURCE); it meets the oldest matching send.

        Args:
            rank: the receiver; src: the sender or ANY_SOURCE; tag: the message's tag.
            buf: where the data lands (an exchange's receiver applies it itself), or None.
            nbytes: its size; t: the virtual time it is posted.
            code, facts: its collective's code and (length, dtype), checked against the send.
            algorithm: the all-reduce it belongs to, or "".

        Returns:
            The ``Post``: ``done`` once its transfer is through.

        Raises:
            CollectiveMismatch, BufferMismatch: the send it meets now does not match.
        """
        post = Post(False, rank, src, tag, buf, nbytes, t, code, facts, algorithm)
        waiting = self._sends.get((rank, tag), [])
        for i, s in enumerate(waiting):
            if src in (s.rank, ANY_SOURCE):
                del waiting[i]
                self._meet(s, post, receiver_now=True)
                return post
        self._recvs.setdefault((rank, tag), []).append(post)
        return post

    def wait(self, actor: Actor, posts: list[Post], what: str) -> None:
        """Block ``actor`` until every one of ``posts`` is done; raise a receive's mismatch
        error."""
        pending = self.expect(actor, posts)
        if pending:
            self.engine.block(actor, what, tuple(sorted({p.peer for p in pending})))
        for p in posts:
            if p.error is not None:
                raise p.error

    @staticmethod
    def expect(actor: Actor, posts: list[Post]) -> list[Post]:
        """The posts not done yet; each wakes ``actor`` once the last of them is (``_done``)."""
        pending = [p for p in posts if not p.done and p.error is None]
        actor.pending = len(pending)
        for p in pending:
            p.actor = actor
        return pending

    def diagnose(self, rank: int) -> Exception | None:
        """At a deadlock, clause 3 of the mismatch contract: ``rank`` waits on a message a peer will
        never send because that peer is in another collective (it waits with a post of another
        code): a ``CollectiveMismatch`` naming both ranks and both calls; None if no such peer."""
        posts = [
            p for table in (self._sends, self._recvs) for waiting in table.values() for p in waiting
        ]
        for mine in (p for p in posts if p.rank == rank):
            for theirs in posts:
                if (
                    theirs.rank != rank
                    and mine.peer in (theirs.rank, ANY_SOURCE)
                    and theirs.code != mine.code
                    and max(theirs.code, mine.code) >= COLLECTIVE_TAG
                ):
                    return collective_mismatch(rank, mine.code, theirs.rank, theirs.code)
        return None

    # -- transfers -------------------------------------------------------------------------------
    def transfer(self, src: int, dst: int, nbytes: int, at: float, distance: int,
                 on_end: Callable[[float], None], algorithm: str = "",
                 footprint: float = 0) -> Task:
        """Queue a message's transfer, eligible from ``at``; ``on_end(t)`` once it is through.

        Where ranks are threads of one process and the link is a copy on the device, the message is
        through once its host work (alpha) is done, and its bytes follow on the device, behind.

        Args:
            src, dst: the sending and the receiving rank.
            nbytes: the message's size.
            at: the virtual time from which it may start (both sides posted).
            distance: (dst - src) mod p, which orders messages eligible at one time.
            on_end: called with the virtual time the message is through.
            algorithm: the all-reduce it belongs to ("" if none): the link's terms for it.
            footprint: the bytes its collective works on at the receiver's node (every rank's
                buffer there): once they fill the link's cache, its bytes cost ``past_cache_beta``.

        Returns:
            The queued ``Task``.
        """
        route = self._routes.get((src, dst, algorithm)) or self._route(src, dst, algorithm)
        alpha, beta, resources, hosted, link = route
        if link.cache_bytes:
            beta = link.beta_at(footprint)
        order = self.engine.order(distance, src)
        if hosted:
            device, copy_s = self.devices[dst], nbytes * beta

            def through(end: float) -> None:
                on_end(end)
                self.engine.submit(Task([(device, copy_s)], _nothing, (end, order)), end)

            task = Task([(self.hosts[dst], self.host_alpha[dst])], through, (at, order))
        else:
            seconds = alpha + nbytes * beta
            task = Task([(r, seconds) for r in resources], on_end, (at, order))
        self.engine.submit(task, at)
        return task

    def holds(self, src: int, dst: int, nbytes: int) -> list[tuple[Resource, float]]:
        """What a message of ``nbytes`` from ``src`` to ``dst`` holds, and for how long (on a
        cluster of threads, a copy on the device holds its host for alpha, then the device)."""
        alpha, beta, resources, _, _ = self._routes.get((src, dst, "")) or self._route(src, dst)
        seconds = alpha + nbytes * beta
        return [(r, seconds) for r in resources]

    def _route(self, src: int, dst: int, algorithm: str = ""
               ) -> tuple[float, float, list[Resource], bool, Any]:
        """The link between two ranks (alpha, beta, for ``algorithm``'s messages), the resources a
        message on it holds, and whether its host work runs ahead of the device (ranks as threads):
        made once per pair and algorithm; last, the link itself (its cache)."""
        crowded = self.node_ranks[dst] > self.cluster.devices_per_node
        link = self.cluster.link(src, dst).for_algorithm(algorithm, crowded)
        level = "intra" if self.cluster.node_of(src) == self.cluster.node_of(dst) else "inter"
        if link.on_device:
            resources = [self.devices[dst]]
        else:
            resources = [self._port(level, "tx", src, link.ranks_per_port),
                         self._port(level, "rx", dst, link.ranks_per_port)]
        route = (link.alpha, link.beta, resources, link.on_device and self.hosts is not None, link)
        self._routes[(src, dst, algorithm)] = route
        return route

    def _port(self, level: str, way: str, rank: int, share: int) -> Resource:
        node, slot = divmod(rank, self.cluster.ranks_per_node)
        key = (level, way, node, slot // share)
        port = self._ports.get(key)
        if port is None:
            port = self._ports[key] = Resource(f"node {node} {level} port {slot // share} {way}")
        return port

    def _meet(self, s: Post, r: Post, receiver_now: bool) -> None:
        """A send met a receive: check them (the mismatch contract), then queue their transfer."""
        s.other, r.other = r, s
        error = _mismatch(s, r)
        if error is not None:
            r.error = error
            if receiver_now:
                raise error
            if r.actor is not None:  # the receiver waits already: it wakes with the error
                r.actor.error = error
                self.engine.wake(r.actor, self.engine.now)
            return
        distance = (r.rank - s.rank) % self.p  # rotated: rank r serves r+1, r+2, ... first
        task = self.transfer(s.rank, r.rank, s.nbytes, max(s.t, r.t), distance,
                             lambda end: self._done(s, r, task), s.algorithm, s.footprint)

    def _done(self, s: Post, r: Post, task: Task) -> None:
        s.start = r.start = task.start
        s.end = r.end = task.end
        self.bytes_moved += s.nbytes
        if s.buf is not None:
            if r.tag == EXCHANGE_TAG:
                r.data = _copy(s.buf)  # applied by the receiver, in its own order
            else:
                _assign(r.buf, s.buf)
        s.buf = r.buf = None  # copied: the posts (a cycle, s <-> r) must not keep the arrays alive
        for post in (s, r):
            post.done = True
            if post.actor is not None:
                post.actor.pending -= 1
                if post.actor.pending == 0:
                    self.engine.wake(post.actor, task.end)


def _nothing(end: float) -> None:
    """A task nobody waits for (a copy the device runs behind its host)."""


def _mismatch(s: Post, r: Post) -> Exception | None:
    """Clause 1 or 2 of the mismatch contract (``dplab.reference.communicator``), or None."""
    if s.code != r.code:
        return collective_mismatch(r.rank, r.code, s.rank, s.code)
    mine = r.facts if r.facts is not None else _facts(r.buf, r.nbytes)
    theirs = s.facts if s.facts is not None else _facts(s.buf, s.nbytes)
    if mine != theirs or s.nbytes != r.nbytes:
        what = "a collective" if r.facts is not None else "a send and its receive"
        return BufferMismatch(
            f"rank {r.rank} expected {mine[0]} x {mine[1]} from rank {s.rank} but rank "
            f"{s.rank} sent {theirs[0]} x {theirs[1]}: every rank must pass a buffer of "
            f"the same length and dtype to {what}"
        )
    return None


def _facts(buf: Any, nbytes: int) -> tuple[int, str]:
    """(length, dtype) of a numpy array or torch tensor; (bytes, "bytes") for a timing-only post."""
    if buf is None:
        return nbytes, "bytes"
    return len(buf.reshape(-1)), str(buf.dtype).removeprefix("torch.")


def _copy(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.copy()
    from dplab.backends.sim.compute import uncharged

    with uncharged():
        return x.clone()


def _assign(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for numpy arrays and torch tensors alike."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst.reshape(-1), src.reshape(-1))
        return
    import torch

    from dplab.backends.sim.compute import uncharged

    d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with uncharged():  # the transfer prices this
        d.view(-1).copy_(s.reshape(-1))
