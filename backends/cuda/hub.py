"""What the rank threads of one process share: an inbox per rank, and how a rank waits on it.

A message is a view of the sender's own buffer; nothing is copied to send it. The receiver reads
the view (adding it into its buffer or copying it over) and hands the message back; the sender
touches the buffer again only after that. Ranks on one GPU enqueue onto its one stream, so this
order of the host's hand-offs is the order of the kernels; ranks on different GPUs add CUDA events
(``ready`` on the sender's stream, ``consumed`` on the receiver's), and the host never waits for
the device either way:

    sender                              receiver
    post(view, ready) ----------------> take(): buf += view   (after ready)
    wait_acks()        <---------------- ack(consumed)

Waits are bounded by the communicator's timeout (``CommTimeout`` naming the peer). A rank waiting
on a peer whose pending message belongs to another collective raises ``CollectiveMismatch`` at
once (the contract in ``dplab.reference.communicator``): senders finish a collective only after
every receiver has taken its messages, so a peer's message of another collective means that peer
called something else.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dplab.reference.communicator import (
    ANY_SOURCE,
    COLLECTIVE_TAG,
    CommTimeout,
    collective_mismatch,
)

__all__ = ["Message", "Hub"]


class Message:
    """One send: ``data`` (the sender's view), ``ready`` (its event, None for host memory),
    ``key`` (tag, round, chunk) that the receive names, ``facts`` (the whole buffer's length and
    dtype, for the mismatch check), and once taken, the receiver's ``consumed`` event."""

    __slots__ = ("src", "dst", "key", "data", "ready", "facts", "consumed", "done")

    def __init__(self, src: int, dst: int, key: tuple, data: Any, ready: Any, facts: Any) -> None:
        self.src, self.dst, self.key = src, dst, key
        self.data, self.ready, self.facts = data, ready, facts
        self.consumed, self.done = None, False


class Hub:
    """The inboxes of ``world_size`` rank threads; made before the ranks' process forks."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.inbox: list[list[Message]] = [[] for _ in range(world_size)]
        self.cond = [threading.Condition() for _ in range(world_size)]  # rank r waits on cond[r]

    def post(self, msg: Message) -> Message:
        with self.cond[msg.dst]:
            self.inbox[msg.dst].append(msg)
            self.cond[msg.dst].notify()
        return msg

    def take(self, me: int, src: int, key: tuple) -> Message:
        """The message for ``me`` from ``src`` (or ANY_SOURCE) under ``key``, waiting for it."""
        box = self.inbox[me]

        def found() -> Message | None:
            for i, m in enumerate(box):
                if m.key == key and (src == ANY_SOURCE or m.src == src):
                    return box.pop(i)
            self._check_peer(me, src, key[0])
            return None

        return self._wait(me, found, src, f"a message (tag {key[0]}, round {key[1]})")

    def ack(self, msg: Message, consumed: Any) -> None:
        """The receiver is done reading ``msg`` once ``consumed`` (an event, or None) has passed."""
        with self.cond[msg.src]:
            msg.consumed, msg.done = consumed, True
            self.cond[msg.src].notify()

    def wait_ack(self, me: int, msg: Message) -> Any:
        """Wait until ``msg``'s receiver has taken it; its ``consumed`` event."""
        def taken() -> bool:
            if not msg.done:
                self._check_peer(me, msg.dst, msg.key[0])
            return msg.done

        self._wait(me, taken, msg.dst,
                   f"its receive of a message (tag {msg.key[0]}, round {msg.key[1]})")
        return msg.consumed

    def _check_peer(self, me: int, peer: int, tag: int) -> None:
        """Inside a collective, a pending message of ``peer`` under another
        collective's code: a mismatch."""
        if tag < COLLECTIVE_TAG:
            return
        for m in self.inbox[me]:
            if m.key[0] != tag and m.key[0] >= COLLECTIVE_TAG and peer in (m.src, ANY_SOURCE):
                raise collective_mismatch(me, tag, m.src, m.key[0])

    def _wait(self, me: int, ready: Any, peer: int, what: str) -> Any:
        cond = self.cond[me]
        deadline = time.monotonic() + self.timeout
        with cond:
            while not (got := ready()):
                left = deadline - time.monotonic()
                if left <= 0:
                    who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
                    raise CommTimeout(f"rank {me} waited {self.timeout:g} s for {what} from {who}")
                cond.wait(left)
        return got
