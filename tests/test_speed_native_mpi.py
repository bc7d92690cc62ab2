"""MPI's native all-reduce checks shapes with a few point-to-point messages, and still says so.

dplab's ``native`` (what ``algorithm="auto"`` runs where MPICH is fastest) must first learn that
every rank passed the same length and dtype: MPI sums garbage or waits forever otherwise. The check
was an ``MPI_Iallreduce`` of four integers, which cost more than the all-reduce it guarded at small
sizes; it is now a dissemination over persistent requests (``MpiComm._agree``). These tests
hold the structure (no engine collective but the data's own, ceil(log2 p) messages a rank, requests
made once) and the behaviour (every rank raises ``BufferMismatch``, and the world stays usable).
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.reference.collectives import allreduce
from dplab.reference.communicator import BufferMismatch

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world(worlds):
    """``world(p)``: the session's persistent MPI world of ``p`` ranks (skips without MPI)."""
    from dplab.backends.mpi.setup import available

    if (why := available()) is not None:
        pytest.skip(why)
    return lambda p: worlds(p, "mpi")


@pytest.fixture
def mpi(world):
    return world


class _Counting:
    """Stands in for the mpi4py communicator and counts the calls made through it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, Counter()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def job_count_calls(comm, calls: int):
    for reqs, *_ in comm._agreement or ():  # a shared world may have made them in an earlier test:
        for req in reqs:                     # free them, so that this count sees them made
            req.Free()
    comm._agreement = None
    inner = comm._comm
    comm._comm = counting = _Counting(inner)
    try:
        buf = np.full(1000, comm.rank + 1.0, np.float32)
        for _ in range(calls):
            allreduce(comm, buf, "native")
    finally:
        comm._comm = inner
    return dict(counting.calls), buf[:3].tolist()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_check_is_point_to_point_made_once_and_the_data_one_mpi_allreduce(world, p):
    calls, k = 5, math.ceil(math.log2(p))
    for counted, head in world(p).run(job_count_calls, calls):
        assert head == [float(sum(range(1, p + 1)) * p ** (calls - 1))] * 3
        assert counted.get("Allreduce") == calls, counted
        # once, not per call
        assert counted.get("Recv_init") == counted.get("Send_init") == k, counted
        assert not {"Iallreduce", "Irecv", "Isend", "Allgather", "Iallgather"} & set(counted), (
            counted
        )


def job_odd_one_out(comm, odd: int, kind: str):
    """Rank ``odd`` passes another length or dtype; every rank catches what it gets and then all run
    a matching native all-reduce: the check leaves no message behind."""
    n, dtype = 10, np.float64
    if comm.rank == odd:
        n, dtype = (11, dtype) if kind == "length" else (n, np.int64)
    try:
        allreduce(comm, np.ones(n, dtype), "native")
        caught = None
    except BufferMismatch as e:
        caught = str(e)
    after = np.full(7, comm.rank + 1.0)
    allreduce(comm, after, "native")
    return caught, after.tolist()


# p = 5 is slow: an MPI world of its own for these two cases (5-16 CPU s); 2, 3 and 4 stay
@pytest.mark.parametrize("p, odd, kind", [(2, 1, "length"), (3, 0, "dtype"), (4, 3, "length"),
                                          pytest.param(5, 2, "length", marks=pytest.mark.slow),
                                          pytest.param(5, 4, "dtype", marks=pytest.mark.slow)])
def test_every_rank_gets_buffer_mismatch_and_the_next_call_works(world, p, odd, kind):
    w = world(p)  # started before the clock: an MPI world's start under load can take 15 s
    t0 = time.monotonic()
    results = w.run(job_odd_one_out, odd, kind)
    assert time.monotonic() - t0 < w.timeout
    for caught, after in results:
        assert caught is not None and "BufferMismatch" not in caught  # the message, not the name
        assert "native all-reduce" in caught and "same length and dtype" in caught, caught
        if kind == "length":
            assert "between 10 and 11 elements" in caught, caught
        assert after == [float(sum(range(1, p + 1)))] * 7


def job_one_in_a_ring(comm):
    buf = np.ones(100)
    return allreduce(comm, buf, "ring" if comm.rank == 0 else "native")


def test_a_rank_in_another_collective_is_named_at_once_with_four_ranks(mpi):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_one_in_a_ring, 4, backend="mpi", timeout=120.0)
    assert time.monotonic() - t0 < 60  # not the 120 s timeout (the world's start included)
    assert "CollectiveMismatch" in str(err.value) and "allreduce(ring)" in str(err.value), str(
        err.value
    )


def job_absent(comm):
    if comm.rank == 0:
        time.sleep(4)  # never joins: the others time out naming it
        return None
    return allreduce(comm, np.ones(4), "native")


def test_a_rank_that_never_joins_is_named_at_the_timeout(mpi):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_absent, 2, backend="mpi", timeout=1.0)
    assert time.monotonic() - t0 < 60  # 1 s, then an end (loose: load)
    assert "CommTimeout" in str(err.value) and "rank 0 to join the native all-reduce" in str(
        err.value
    )
