"""The torch.distributed backend: gloo on CPU, NCCL on GPUs (one GPU per rank).

    dplab train --backend torch --world-size 4                 # ranks forked here, gloo on loopback
    # torchrun's ranks, on gloo; with DPLAB_DEVICE=cuda, on NCCL
    torchrun --nproc-per-node 4 -m dplab.backends.cli train --backend torch
    DPLAB_DEVICE=cuda torchrun --nproc-per-node 4 -m dplab.backends.cli train --backend torch

``DPLAB_DEVICE=cuda`` picks NCCL and GPU ``LOCAL_RANK`` (N ranks need N GPUs, else a
``ConfigError``). Numpy arrays go through ``torch.from_numpy``; under NCCL a host buffer is copied
to the GPU and back. This file runs a schedule's rounds (messages: ``p2p.py``). Mismatch contract: a
collective's first message on each link carries the buffer's (length, dtype) and the collective's
code, checked by ``check_buffer``: another collective is a ``CollectiveMismatch`` (1), another
buffer a ``BufferMismatch`` (2); the native all-reduce first all-reduces (n, dtype, -n, -dtype) with
MAX. gloo cannot probe, so a rank with nothing to compare meets (3) by ``CommTimeout`` naming the
peer, and a bare ``exchange`` with mismatched shapes times out. On gloo each round posts the next
round's receives it cannot disturb (``early_receives``; why: backends/README.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from dplab.backends.fastpath.executor import Plan, schedule_plan
from dplab.backends.torchdist.p2p import DTYPES, HEADER_TAG, TorchPeer, code, data_tag
from dplab.backends.torchdist.setup import torch_modules as _torch
from dplab.reference.communicator import (
    BufferMismatch,
    Collective,
    CommError,
    RecvSpec,
    collective_mismatch,
    require_writable,
)
from dplab.reference.errors import ConfigError
from dplab.reference.schedule import chunk_bounds

if TYPE_CHECKING:
    from dplab.reference.communicator import SendSpec

__all__ = ["TorchComm", "early_receives"]

LINK_TAG = HEADER_TAG + 1  # the header on a collective's first message over a link
PIECE_BYTES = 1 << 20  # gloo moves a longer message in pieces of this size (see _pieces)


class _Incoming:
    """One receive of a round: where it lands, and (once posted) its works."""

    __slots__ = ("spec", "t", "host", "land", "work", "header", "header_work")

    def __init__(self, spec: RecvSpec, t: Any, host: Any, land: Any, header: Any) -> None:
        self.spec, self.t, self.host, self.land, self.header = spec, t, host, land, header
        self.work: list = []
        self.header_work = None


class TorchComm(TorchPeer):
    """One rank of a torch.distributed process group, speaking dplab's Communicator.

    Built by ``launch`` for its ranks, or by ``TorchComm.from_process_group()`` inside a group the
    caller started.

    Args:
        *args: ``TorchPeer``'s: ``rank``, ``world_size``, ``timeout``, ``init_method``, ``device``,
            ``local_rank``, ``store``, ``group``.
        **kwargs: the same, by name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch: dict[Any, Any] = {}  # (dtype, slot) -> where a reduce lands
        self._early: dict[int, dict] = {}  # round -> receives posted for it a round early
        # (length, dtype code, call code) of this collective
        self._buffer: tuple[int, int, int] | None = None
        # (buffer, chunk bounds, plan, early) of this collective (gloo)
        self._rounds: tuple | None = None
        self._told: set[int] = set()  # peers this collective has sent its header to
        self._heard: set[int] = set()  # peers it expects a header from

    def check_buffer(self, buf: Any, call: Collective | None = None) -> None:
        """A collective begins: its first message to (and from) each peer carries the header.
        The schedule joins every rank to every other, so if two ranks disagree, some link joins
        two that do, and its receiver raises ``BufferMismatch`` (or ``CollectiveMismatch``) at
        its first message. On gloo, remember the plan: rounds post receives early from it.

        Args:
            buf: the collective's whole (flat) buffer.
            call: the collective whose rounds follow; None for a bare exchange.
        """
        self._buffer = (int(np.prod(buf.shape)), code(buf), call.code() if call is not None else 0)
        self._told, self._heard = set(), set()
        self._rounds = None
        if call is not None and not self.nccl:
            (chunks, plan), early = _early_plan(call, self.world_size, self.rank)
            self._rounds = (buf, chunk_bounds(len(buf), chunks), plan, early)

    def native_allreduce(self, buf: Any, op: str = "sum", check: bool = True) -> None:
        """gloo's (or NCCL's) own all-reduce, in place: the yardstick for ours. With ``check``,
        a 4-integer MAX all-reduce of (n, dtype, -n, -dtype) goes first (max and -min agree only
        if every rank agrees): gloo aborts the process on a longer buffer and sums a same-size
        buffer of another dtype into garbage. ``dplab bench`` times it without, as users call it.

        Args:
            buf: a writable numpy array or tensor, summed in place.
            op: ``"sum"`` or ``"mean"``.
            check: first check that every rank passed the same length and dtype.

        Raises:
            ConfigError: a read-only buffer, or an unknown ``op``.
            BufferMismatch: ranks passed buffers of different lengths or dtypes (with ``check``).
            CommTimeout: a peer did not join within the timeout.
            PeerLost: a peer died.
        """
        torch, dist = _torch()
        require_writable(buf)
        if op not in ("sum", "mean"):
            raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
        t, host = self._on_device(buf)
        everyone = list(range(self.world_size))
        with self._explain(everyone, "in all_reduce"):
            if check:
                n, c = t.numel(), code(t)
                shape = torch.tensor([n, c, -n, -c], dtype=torch.int64, device=self.device)
                dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self._group,
                                async_op=True).wait(self._td)
                hi_n, hi_c, lo_n, lo_c = (abs(int(v)) for v in shape.cpu())
                if (hi_n, hi_c, lo_n, lo_c) != (n, c, n, c):
                    raise BufferMismatch(
                        f"rank {self.rank} passed {n} x {DTYPES[c]} to all_reduce, lengths "
                        f"span {lo_n}..{hi_n}, dtypes {DTYPES[lo_c]}..{DTYPES[hi_c]}: every "
                        "rank must pass a buffer of the same length and dtype to a collective")
            dist.all_reduce(t, group=self._group, async_op=True).wait(self._td)
        if op == "mean":
            t /= self.world_size
        if host is not None:
            host.copy_(t)

    # -- one round of a schedule --------------------------------------------------------------
    def exchange(self, sends: list[SendSpec], recvs: list[RecvSpec], round: int = -1,
                 algorithm: str = "") -> None:
        """Post the round's receives (unless posted a round early) and sends, add each received
        chunk as it lands, post the next round's early receives (``_ahead``), then wait for the
        sends. None early on NCCL: it runs a rank's batches in order on one stream, where an early
        receive would hold back this rank's own next send; there the round is one batch (headers
        in one before).

        Args:
            sends: this round's messages out (buffer, peer, chunk).
            recvs: this round's messages in, each added (reduce) or copied into its buffer.
            round: the round's index within the collective; -1 for a bare exchange.
            algorithm: the collective's algorithm, for traces and errors.

        Raises:
            CommError: receives were posted early for this round that it does not ask for.
            CollectiveMismatch: a peer is in another collective.
            BufferMismatch: a peer's buffer has another length or dtype.
            CommTimeout: a peer did not answer within the timeout.
            PeerLost: a peer died.
        """
        tr, what = self.tracer, f"in round {round} of {algorithm or 'an exchange'}"
        t_post = tr.now() if tr.enabled else 0
        early, ins, fresh = self._early.pop(round, {}), [], []  # fresh: not posted last round
        for k, r in enumerate(recvs):
            inc = early.pop((r.peer, r.chunk), None)
            if inc is None:
                inc = self._incoming(r, round, k)
                fresh.append(inc)
            ins.append(inc)
        if early:
            raise CommError(f"rank {self.rank}: receives posted for round {round} were not "
                            "asked for")
        out = [self._on_device(s.buf)[0] for s in sends]
        peers = [r.peer for r in recvs] + [s.peer for s in sends]
        with self._explain(peers, what):
            if self.nccl:
                self._run_batch(ins, out, sends, what)
                works = [[] for _ in sends]  # done with the batch
            else:
                for inc in fresh:
                    self._post(inc)
                works = [self._send(t, s.peer) for t, s in zip(out, sends)]
        for inc in ins:
            t0 = tr.now() if tr.enabled else 0
            self._take(inc, what)
            if tr.enabled:
                tr.record("reduce" if inc.spec.reduce else "copy", t0, tr.now(), peer=inc.spec.peer,
                          bytes=inc.t.nbytes, chunk=inc.spec.chunk, round=round,
                          algorithm=algorithm)
        ahead = self._ahead(round)
        if ahead:
            with self._explain(peers, what):
                self._early[round + 1] = {(r.peer, r.chunk): self._post(self._incoming(r, round + 1,
                                                                                       k, True))
                                          for k, r in enumerate(ahead)}
        for work, t, s in zip(works, out, sends):
            self._finish(work, [s.peer] * len(work), what)
            if tr.enabled:
                tr.record("send", t_post, tr.now(), peer=s.peer, bytes=t.nbytes, chunk=s.chunk,
                          round=round, algorithm=algorithm)

    def _ahead(self, round: int) -> list[RecvSpec]:
        """The receives of round ``round + 1`` that may be posted now
        (gloo, inside a collective)."""
        if self._rounds is None or round < 0:
            return []
        buf, bounds, plan, early = self._rounds
        if round + 1 >= len(plan):
            return []
        later = plan[round + 1][1]
        return [RecvSpec(buf[bounds[t.chunk][0]:bounds[t.stop - 1][1]], t.src, t.chunk,
                         t.op == "reduce")
                for t in (later[i] for i in early[round])]

    def _incoming(self, r: RecvSpec, round: int, k: int, early: bool = False) -> _Incoming:
        """A reduce lands in scratch kept per (round parity, early or not, k): a receive posted a
        round early never shares scratch with one still being added. The collective's first
        message from a peer brings a header."""
        t, host = self._on_device(r.buf)
        land = self._scratch_for(t, (round % 2, early, k)) if r.reduce else t
        header = None
        if self._buffer is not None and r.peer not in self._heard:
            self._heard.add(r.peer)
            header = _torch()[0].zeros(3, dtype=_torch()[0].int64, device=self.device)
        return _Incoming(r, t, host, land, header)

    def _post(self, inc: _Incoming) -> _Incoming:
        """gloo: post the header's receive (if any) and the data's, piece by piece, each under
        its shape's tag."""
        if inc.header is not None:
            inc.header_work = self._irecv(inc.header, inc.spec.peer, LINK_TAG)
        inc.work = [
            self._irecv(piece, inc.spec.peer, data_tag(piece)) for piece in _pieces(inc.land)
        ]
        return inc

    def _send(self, t: Any, peer: int) -> list:
        """gloo: post the header (the collective's first message to ``peer``) and the data."""
        header = self._header_for(peer)
        works = [self._isend(header, peer, LINK_TAG)] if header is not None else []
        return works + [self._isend(piece, peer, data_tag(piece)) for piece in _pieces(t)]

    def _header_for(self, peer: int) -> Any:
        if self._buffer is None or peer in self._told:
            return None
        self._told.add(peer)
        return _torch()[0].tensor(self._buffer, dtype=_torch()[0].int64, device=self.device)

    def _take(self, inc: _Incoming, what: str) -> None:
        """Wait for a receive (its header first: a mismatch is an error before any data is used),
        then add or copy it into place."""
        r = inc.spec
        if inc.header_work is not None:
            self._finish([inc.header_work], [r.peer], what)
        if inc.header is not None:
            self._check_link(inc.header, r.peer)
        if r.reduce and inc.work:  # gloo: add each piece as it lands, while the next is on the wire
            for work, piece, into in zip(inc.work, _pieces(inc.land), _pieces(inc.t)):
                self._finish([work], [r.peer], what)
                into.add_(piece)
        else:  # a copy lands in place; on NCCL the batch has landed already (no works)
            self._finish(inc.work, [r.peer] * len(inc.work), what)
            if r.reduce:
                inc.t.add_(inc.land)
        if inc.host is not None:
            inc.host.copy_(inc.t)

    def _check_link(self, header: Any, peer: int) -> None:
        (n, c, call), (mine, my_code, my_call) = (int(v) for v in header.cpu()), self._buffer
        if call != my_call:
            raise collective_mismatch(self.rank, my_call, peer, call)
        if (n, c) != (mine, my_code):
            raise BufferMismatch(f"rank {self.rank} passed {mine} x {DTYPES[my_code]} to a "
                                 f"collective but rank {peer} passed {n} x {DTYPES[c]}: every "
                                 "rank must pass a buffer of the same length and dtype to "
                                 "a collective")

    def _run_batch(self, ins: list[_Incoming], out: list, sends: list[SendSpec], what: str) -> None:
        """NCCL: the link headers as one batch, checked, then the data
        as one (NCCL's group calls)."""
        _, dist = _torch()
        peers = [inc.spec.peer for inc in ins] + [s.peer for s in sends]
        heads = [dist.P2POp(dist.irecv, inc.header, inc.spec.peer) for inc in ins
                 if inc.header is not None]
        heads += [dist.P2POp(dist.isend, h, s.peer) for s in sends
                  if (h := self._header_for(s.peer)) is not None]
        if heads:
            self._finish(dist.batch_isend_irecv(heads), peers, what)
        for inc in ins:
            if inc.header is not None:
                self._check_link(inc.header, inc.spec.peer)
            inc.header = None
        data = [dist.P2POp(dist.irecv, inc.land, inc.spec.peer) for inc in ins if inc.land.numel()]
        data += [dist.P2POp(dist.isend, t, s.peer) for t, s in zip(out, sends) if t.numel()]
        if data:
            self._finish(dist.batch_isend_irecv(data), peers, what)

    def _scratch_for(self, t: Any, slot: tuple) -> Any:
        """Where a reduce lands: scratch per slot that grows to the largest seen, then is reused."""
        have = self._scratch.get((t.dtype, slot))
        if have is None or have.numel() < t.numel():
            have = _torch()[0].empty(t.numel(), dtype=t.dtype, device=self.device)
            self._scratch[t.dtype, slot] = have
        return have[:t.numel()]


@lru_cache(maxsize=1024)
def _early_plan(call: Collective, p: int, rank: int) -> tuple[tuple[int, Plan], list[list[int]]]:
    """((chunks, plan), early receives) of ``call`` on this rank: worked
    out once per collective kind."""
    schedule, plan = schedule_plan(call.kind, call.algorithm, p, rank, max(call.root, 0))
    return (schedule.num_chunks, plan), early_receives(plan)


def early_receives(plan: Plan) -> list[list[int]]:
    """For each round k, which of round k+1's receives round k cannot disturb, so that they may
    be posted during round k: those that land in scratch (reduce) and those into a chunk round
    k neither sends nor receives. A peer's receives go ahead all or none, so that messages
    between two ranks are still posted in the order they are sent.

    Args:
        plan: this rank's (sends, receives) per round.

    Returns:
        Per round, the indices of the next round's receives it may post early (the last: none).
    """
    early = []
    for (sends, recvs), (_, later) in zip(plan, plan[1:]):
        # messages: chunk..stop-1
        busy = {c for t in (*sends, *recvs) for c in range(t.chunk, t.stop)}
        held = {t.src for t in later if t.op != "reduce"
                and not busy.isdisjoint(range(t.chunk, t.stop))}
        early.append([i for i, t in enumerate(later) if t.src not in held])
    return early + [[]] if plan else []  # the last round has no next one


def _pieces(t: Any) -> tuple:
    """A message as 1 MiB pieces (none if empty): gloo then moves one piece while the receiver
    adds the one before (16 MiB, 2 ranks: 0.73x of gloo's all_reduce whole, 0.96x in pieces)."""
    per = max(1, PIECE_BYTES // t.element_size())
    return () if not t.numel() else tuple(t.split(per)) if t.numel() > per else (t,)
