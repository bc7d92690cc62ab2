"""The local backend refuses a round that posts more messages to one peer than its mailbox holds
(``backends/local/mailboxes.py`` SLOTS = 64) at once, with a ConfigError that says what to lower,
instead of every rank waiting for a slot until the timeout (``pipelined_ring:65`` at p = 34:
each rank sends 65 slices to its right neighbour in round 64).

    pytest -q tests/test_alg_arrays_slots.py
"""

from __future__ import annotations

import numpy as np
import pytest

from dplab.backends import RankError, allreduce, launch
from dplab.backends.local.mailboxes import SLOTS
from dplab.reference.algorithms import allreduce_schedule

P = 34  # 2 (p - 1) = 66 ring steps: up to 66 slices in flight, so k = SLOTS + 1 is reached


def _warm(k: int) -> None:
    """Build the schedule here, before the fork: the 34 ranks inherit it from the cache instead of
    each spending ~0.15 s of the two cores on it (about 5 s of CPU per launch, ~1/3 of each
    test)."""
    allreduce_schedule(f"pipelined_ring:{k}", P)


def _ring(comm, k: int) -> list[float]:
    buf = np.arange(P * (SLOTS + 1), dtype=np.float64) + comm.rank
    allreduce(comm, buf, algorithm=f"pipelined_ring:{k}")
    return buf[:3].tolist()


def test_a_round_with_more_messages_to_one_peer_than_slots_is_refused_not_waited_out():
    _warm(SLOTS + 1)
    # Refused, not waited out: before, every rank timed out on the mailbox (a CommTimeout, which
    # this match would not take). No clock: on a loaded machine starting the world alone took 13 s.
    with pytest.raises(RankError, match=rf"posts {SLOTS + 1} messages to rank \d+, more than the "
                                        r"local "
                                        rf"backend's {SLOTS} mailbox "
                                        rf"slots.*'pipelined_ring:{SLOTS}'"):
        launch(_ring, P, args=(SLOTS + 1,), timeout=60.0)


@pytest.mark.slow  # 34 ranks on the two cores through the whole pipelined ring: a CPU-minute
def test_exactly_slots_messages_to_one_peer_still_run():
    base = np.arange(3) * P + P * (P - 1) / 2  # sum over ranks of (i + rank)
    _warm(SLOTS)
    assert launch(_ring, P, args=(SLOTS,), timeout=30.0) == [base.tolist()] * P
