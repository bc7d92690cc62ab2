"""Receives posted a round early: gloo's rendezvous trick, kept in the torch backend.

gloo moves a message only once its receive is posted, so the torch backend posts, during
round k, those of round k+1's receives that round k cannot disturb (``early_receives``, from
the collective's plan). The reference executor knows nothing of it. These are the trick's
properties, on the plans of every collective; that gloo takes every early receive in its
round is checked on a real world in ``test_torch_backend.py``.
"""

from __future__ import annotations

import inspect

import pytest

from dplab.backends.torchdist.comm import early_receives
from dplab.reference import collectives
from dplab.reference.algorithms import ALLREDUCE
from dplab.reference.collectives import schedule_plan
from dplab.reference.communicator import Communicator

SCATTER = ("ring", "direct")
ROOTED = ("tree", "naive")


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("kind, algorithm", [("allreduce", a) for a in sorted(ALLREDUCE)]
                         + [(k, a) for k in ("reduce_scatter", "allgather") for a in SCATTER]
                         + [(k, a) for k in ("reduce", "broadcast") for a in ROOTED])
def test_receives_go_ahead_only_where_the_round_before_cannot_disturb_them(kind, algorithm, p):
    for root in range(p) if kind in ("reduce", "broadcast") else [0]:
        for rank in range(p):
            _, plan = schedule_plan(kind, algorithm, p, rank, root)
            early = early_receives(plan)
            assert len(early) == len(plan) and (not early or early[-1] == [])
            for k, ((sends, now), ahead) in enumerate(zip(plan, early)):
                later = plan[k + 1][1] if k + 1 < len(plan) else []
                busy = {t.chunk for t in sends} | {t.chunk for t in now}
                assert all(later[i].op == "reduce" or later[i].chunk not in busy for i in ahead)
                going = {later[i].src for i in ahead}  # a peer's receives go ahead all or none
                assert all((t.src in going) == (i in ahead) for i, t in enumerate(later))


def test_the_ring_posts_every_receive_a_round_early_but_the_one_it_cannot():
    assert [len(e) for e in early_receives(schedule_plan("allreduce", "ring", 4, 0)[1])] == [
        1,
        1,
        1,
        1,
        1,
        0,
    ]
    # p=2: the all-gather copies into the chunk this rank just sent: that one must wait its round
    assert early_receives(schedule_plan("allreduce", "ring", 2, 0)[1]) == [[], []]


def test_the_reference_executor_knows_nothing_of_early_receives():
    """The executor a learner reads hands each round to ``exchange`` and nothing more."""
    assert "early" not in inspect.getsource(collectives) and "ahead" not in inspect.getsource(
        collectives
    )
    assert "ahead" not in inspect.signature(Communicator.exchange).parameters


def job_count_early(comm, algorithm):
    """How many receives this rank posted a round early in one all-reduce (gloo's ``_ahead``)."""
    import numpy as np

    posted, ahead = [], comm._ahead

    def counting(round):
        early = ahead(round)
        posted.extend(early)
        return early

    comm._ahead = counting
    try:
        buf = np.full(1000, comm.rank + 1.0)
        collectives.allreduce(comm, buf, algorithm)
        return len(posted), buf.tolist(), dict(comm._early)
    finally:
        del comm._ahead


@pytest.mark.torch
def test_gloo_posts_the_rings_receives_a_round_early_and_takes_them_all():
    from dplab.backends.launch.world import World
    from dplab.backends.torchdist.setup import available

    if available():
        pytest.skip(f"torch backend unavailable: {available()}")
    with World(4, backend="torch", timeout=30.0) as world:
        for count, buf, left in world.run(job_count_early, "ring"):
            assert count == 5 and left == {}  # [1, 1, 1, 1, 1, 0] per round, all taken
            assert buf == [10.0] * 1000
