"""The mismatch contract (``dplab.reference.communicator.Communicator``), checked on every backend.

Every collective's messages carry what the sender called (``Collective``: kind, algorithm,
root): a tag on shared memory and MPI, the link header on gloo. A rank that receives a
message of another call raises ``CollectiveMismatch`` naming both (clause 1), one of another
length or dtype ``BufferMismatch`` (clause 2), within a round; a rank with nothing to compare
times out naming its peer (clause 3: gloo's known limit, asserted below).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.reference import collectives
from dplab.reference.algorithms import ALGORITHMS, PARAMETRIC, ROOTED, SCATTER
from dplab.reference.communicator import COLLECTIVE_TAG, Collective, describe_tag
from dplab.reference.errors import ConfigError

TIMEOUT = 20.0  # a mismatch must be found long before this


def call(comm, what: str, n: int):
    buf = np.ones(n)
    kind, algorithm, root = what.split(":")
    if kind in ("broadcast", "reduce"):
        return getattr(collectives, kind)(comm, buf, root=int(root), algorithm=algorithm)
    return getattr(collectives, kind)(comm, buf, algorithm=algorithm)


CASES = {  # name: (what rank 0 calls, what the others call, what the error names, n)
    "allreduce-vs-broadcast": (
        "allreduce:ring:",
        "broadcast:tree:0",
        "broadcast(tree, root=0)",
        100,
    ),
    "ring-vs-tree": ("allreduce:ring:", "allreduce:tree:", "allreduce(tree)", 100),
    "root-0-vs-root-1": (
        "broadcast:tree:0",
        "broadcast:tree:1",
        "broadcast(tree, root=1)",
        1 << 20,
    ),
    "scatter-vs-gather": ("reduce_scatter:ring:", "allgather:ring:", "allgather(ring)", 100),
    "ring-vs-native": ("allreduce:ring:", "allreduce:native:", "allreduce(native)", 100),
    # both only send (the root broadcasts, the leaf reduces to it; at p=2 two roots also only send):
    # caught by a sender left waiting (8 MiB: MPI does not send that eagerly; small eager messages
    # leave, both ranks return, and the next collective meets the stray message)
    "both-only-send": ("broadcast:tree:0", "reduce:tree:0", "reduce(tree, root=0)", 1 << 20),
}


def job_mismatch(comm, mine: str, theirs: str, n: int):
    return call(comm, mine if comm.rank == 0 else theirs, n)


GLOO_BLIND = ("ring-vs-native", "both-only-send", "root-0-vs-root-1")  # see the test below


@pytest.mark.parametrize("case", CASES)
def test_a_mismatched_collective_is_named_within_a_round(backend, case):
    mine, theirs, named, n = CASES[case]
    if backend == "torch" and case in GLOO_BLIND:
        return  # test_gloo_cannot_see_these_mismatches_and_times_out_naming_the_peer

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_mismatch, 2, backend=backend, args=(mine, theirs, n), timeout=TIMEOUT)
    took = time.monotonic() - t0
    message = str(err.value)
    assert "CollectiveMismatch" in message, message
    assert named in message and "every rank must call the same collective" in message
    assert took < 8, f"{backend} {case}: {took:.1f}s, the timeout is {TIMEOUT}s"


BUFFER_CASES = {  # name: (what every rank calls, rank 0's (length, dtype), the others')
    "ring-length": ("allreduce:ring:", (100, "float64"), (101, "float64")),
    "ring-dtype": ("allreduce:ring:", (100, "float64"), (100, "float32")),
    "tree-broadcast-length": ("broadcast:tree:0", (1 << 16, "float32"), ((1 << 16) + 1, "float32")),
    "native-length": ("allreduce:native:", (100, "float64"), (101, "float64")),
    "native-dtype": ("allreduce:native:", (100, "float64"), (100, "float32")),
}


def job_buffer_mismatch(comm, what: str, mine: tuple, theirs: tuple):
    n, dtype = mine if comm.rank == 0 else theirs
    buf = np.ones(n, dtype)
    kind, algorithm, root = what.split(":")
    if kind == "broadcast":
        return collectives.broadcast(comm, buf, root=int(root), algorithm=algorithm)
    return collectives.allreduce(comm, buf, algorithm=algorithm)


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_a_mismatched_buffer_is_named_within_a_round(backend, case):
    what, mine, theirs = BUFFER_CASES[case]
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_buffer_mismatch, 2, backend=backend, args=(what, mine, theirs), timeout=TIMEOUT)
    took = time.monotonic() - t0
    message = str(err.value)
    assert "BufferMismatch" in message, message
    assert "every rank must pass a buffer of the same length and dtype" in message, message
    assert took < 8, f"{backend} {case}: {took:.1f}s, the timeout is {TIMEOUT}s"


@pytest.mark.torch
@pytest.mark.parametrize("case", GLOO_BLIND)
def test_gloo_cannot_see_these_mismatches_and_times_out_naming_the_peer(case):
    """The known limit, asserted: a rank inside gloo's own all_reduce, or ranks that only send
    (or only wait), get no message to compare, and gloo cannot probe for one. They wait out the
    timeout and then say which peer and which round they were waiting on."""
    from dplab.backends.torchdist.setup import available

    if (why := available()) is not None:
        pytest.skip(why)
    mine, theirs, _, n = CASES[case]
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(job_mismatch, 2, backend="torch", args=(mine, theirs, n), timeout=2.0)
    took = time.monotonic() - t0
    assert "CommTimeout" in str(err.value) and "rank" in str(err.value), str(err.value)
    assert 1.9 < took < 15, took


def test_collective_codes_round_trip_and_stay_clear_of_user_tags():
    calls = [
        Collective(k, a, r)
        for k in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
        for a in ("naive", "ring", "tree", "direct", "native")
        for r in (-1, 0, 1, 7, 4095)
    ]
    codes = [c.code() for c in calls]
    assert len(set(codes)) == len(calls) and min(codes) >= COLLECTIVE_TAG
    assert [Collective.decode(c) for c in codes] == calls
    assert Collective.decode(0) is None and Collective.decode(COLLECTIVE_TAG - 1) is None
    assert describe_tag(Collective("broadcast", "tree", 1).code()) == "broadcast(tree, root=1)"
    assert describe_tag(5) == "a point-to-point message or exchange (tag 5)"


KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def test_every_registry_algorithm_has_a_code_that_decodes_to_it():
    """The codes come from the one registry (reference/algorithms): every algorithm a collective
    may run, ``native`` included, in every kind and for roots up to 4095, has its own code, and
    a parametrised name's code is its name's (the parameter does not travel)."""
    assert "native" in ALGORITHMS and {*SCATTER, *ROOTED} <= set(ALGORITHMS)
    calls = [Collective(k, a, r) for k in KINDS for a in ALGORITHMS for r in (-1, 0, 3, 4095)]
    codes = [c.code() for c in calls]
    assert len(set(codes)) == len(calls) and min(codes) >= COLLECTIVE_TAG
    assert [Collective.decode(c) for c in codes] == calls
    for name, default in PARAMETRIC.items():
        assert (
            Collective("allreduce", f"{name}:{default + 1}").code()
            == Collective("allreduce", name).code()
        )


def test_a_name_outside_the_registry_has_no_code():
    with pytest.raises(ConfigError, match="no collective code"):
        Collective("allreduce", "auto").code()
    with pytest.raises(ConfigError, match="no collective code"):
        Collective("alltoall", "ring").code()
