"""The error a user sees is the real cause, not the connection a failed peer closed behind it.

When rank 1 times out (or raises) and its gloo connections close, rank 0, still waiting on
rank 1, fails too, with "Connection closed by peer" (``PeerLost``). Whichever report reaches
the launcher first used to be the one shown; now a rank that lost a peer is reported only if
no rank failed for a reason of its own.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.backends.torchdist.setup import available
from dplab.reference.communicator import CommError, PeerLost, RecvSpec, SendSpec


def test_a_rank_that_lost_its_peer_is_not_reported_over_the_peer_that_failed():
    """Deterministic: rank 0's PeerLost arrives first, rank 1's own error 0.3 s later."""
    def fn(comm):
        if comm.rank == 0:
            raise PeerLost("rank 0 lost rank 1 while waiting: that rank died or failed (see its "
                           "error)")
        time.sleep(0.3)
        raise ValueError("the real cause, on rank 1")

    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=5.0)
    assert err.value.rank == 1 and "the real cause, on rank 1" in err.value.detail
    assert issubclass(PeerLost, CommError)


def test_a_rank_that_lost_its_peer_is_reported_when_nobody_else_failed():
    def fn(comm):
        if comm.rank == 1:
            raise PeerLost("rank 1 lost rank 0")
        return comm.rank

    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=5.0)
    assert err.value.rank == 1 and "PeerLost: rank 1 lost rank 0" in err.value.detail


@pytest.mark.torch
@pytest.mark.skipif(available() is not None, reason=f"torch backend unavailable: {available()}")
def test_gloo_reports_the_rank_that_timed_out_not_the_one_whose_connection_it_closed():
    """Rank 0 starts waiting 0.5 s after rank 1: rank 1 times out first and gloo closes the pair,
    so rank 0 fails at once with "Connection closed by peer" (reported first, before the fix)."""
    def fn(comm):
        if comm.rank == 0:
            time.sleep(0.5)
            comm.exchange([], [RecvSpec(np.zeros(4), 1)])
        else:
            comm.exchange([SendSpec(np.zeros(5), 0)], [])

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 2, backend="torch", timeout=2.0)
    assert time.monotonic() - t0 < 60  # 2 s, then an end (loose: load)
    assert err.value.rank == 1, err.value.detail
    assert "CommTimeout: rank 1 waited 2s for rank 0 in round -1" in err.value.detail
