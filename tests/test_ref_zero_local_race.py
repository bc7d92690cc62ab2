"""Regression: the local backend named a CollectiveMismatch where there was none.

A rank waiting for its peer to take a collective's message peeks, now and then, at the message
the peer has posted to it; a message of ANOTHER collective meant the peer was elsewhere. But
between this rank's last look at the ack semaphore and its peek, the peer may take the message
(posting the ack), finish the collective and post its next collective's message: legitimately
ahead. The ZeRO trainer's comm thread runs collectives back to back and hit this about once in
a few hundred steps on two busy cores ("rank 0 called allgather(ring) but rank 1 called
reduce_scatter(ring)"). Here the window is widened on purpose: rank 0's peek is late by 0.2 s,
and rank 1 takes rank 0's message 0.05 s late, so the ack and the next message land inside it.
"""

from __future__ import annotations

import time

import numpy as np

from dplab.backends.launch.world import launch
from dplab.reference.collectives import allgather, reduce_scatter


def _late_peek_then_next_collective(comm):
    if comm.rank == 0:
        peek = comm.mailboxes.peek

        def late_peek(*args):
            time.sleep(0.2)  # the peer acks and posts its next collective meanwhile
            return peek(*args)

        comm.mailboxes.peek = late_peek
    else:
        receive = comm.mailboxes.receive

        def late_recv(*args, **kwargs):
            time.sleep(0.05)  # rank 0 is waiting for the ack by now, peeking
            return receive(*args, **kwargs)

        comm.mailboxes.receive = late_recv
    gathered = allgather(comm, np.full(4, float(comm.rank)), "ring")
    summed = reduce_scatter(comm, np.arange(4.0), "ring")
    return gathered.tolist(), summed.tolist()


def test_a_peer_already_in_its_next_collective_is_not_a_mismatch():
    results = launch(_late_peek_then_next_collective, 2, backend="local", timeout=10)
    assert results[0] == ([0.0, 0.0, 1.0, 1.0], [0.0, 2.0])
    assert results[1] == ([0.0, 0.0, 1.0, 1.0], [4.0, 6.0])
