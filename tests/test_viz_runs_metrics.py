"""The Runs page's numbers: interval arithmetic and per-rank stats on hand-made spans (exact
values)."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from dplab.reference.trace import Event  # noqa: E402
from dplab.viz.timeline_metrics import (  # noqa: E402
    configured_stragglers,
    find_straggler,
    intersect,
    measure,
    rank_stats,
    subtract,
    totals,
    union,
)


def test_union_merges_overlaps_and_touching_and_drops_empty() -> None:
    assert union([(5, 9), (0, 3), (2, 4), (9, 10), (12, 12), (20, 15)]) == [(0, 4), (5, 10)]
    assert measure([(0, 10), (2, 3), (5, 15)]) == 15
    assert measure([]) == 0


def test_intersect_and_subtract_exact() -> None:
    comm = [(0, 10), (20, 30)]
    compute = [(5, 25), (28, 40)]
    assert intersect(comm, compute) == [(5, 10), (20, 25), (28, 30)]
    assert subtract(comm, compute) == [(0, 5), (25, 28)]
    assert subtract(compute, comm) == [(10, 20), (30, 40)]
    assert subtract([(0, 10)], [(0, 10)]) == []
    assert subtract([(0, 10)], [(2, 3), (4, 5)]) == [(0, 2), (3, 4), (5, 10)]
    # the two parts always add up to the whole
    assert measure(intersect(comm, compute)) + measure(subtract(comm, compute)) == measure(comm)


def ev(rank: int, kind: str, a: int, b: int, thread: str = "main") -> Event:
    return Event(rank, kind, a, b, thread=thread)


def test_rank_stats_on_a_hand_made_sync_step() -> None:
    """Rank 0: backward 0-100, a bucket 60-160 on the comm thread (with its nested all-reduce and
    send, which must not count twice), wait 100-160, optimizer 160-170, loss all-reduce 170-190."""
    events = [
        ev(0, "forward", -50, 0),
        ev(0, "backward", 0, 100),
        ev(0, "bucket", 60, 160, "comm"),
        ev(0, "allreduce", 62, 158, "comm"),
        ev(0, "send", 70, 90, "comm"),
        ev(0, "wait", 100, 160),
        ev(0, "optimizer", 160, 170),
        ev(0, "allreduce", 170, 190),
        # rank 1: a straggler, 4x the compute, its sleeps inside its backward; no waiting
        ev(1, "forward", -50, 150),
        ev(1, "slowdown", 0, 150),
        ev(1, "backward", 150, 350),
        ev(1, "bucket", 350, 400, "comm"),
        ev(1, "wait", 350, 400),
        ev(1, "optimizer", 400, 410),
    ]
    s0, s1 = rank_stats(events)
    assert (s0.rank, s0.role, s0.span_ns) == (0, "replica", 240)
    assert s0.compute_ns == 50 + 100 + 10
    assert s0.comm_ns == 100 + 20  # the bucket (its all-reduce and send inside it) + the loss's
    assert s0.overlapped_ns == 40  # bucket 60-100 under backward
    assert s0.exposed_ns == 80  # 100-160 and 170-190
    assert s0.overlap_pct == pytest.approx(100 * 40 / 120)
    assert s0.wait_ns == 60 and s0.slowdown_ns == 0
    assert (
        s1.compute_ns,
        s1.comm_ns,
        s1.overlapped_ns,
        s1.exposed_ns,
        s1.wait_ns,
        s1.slowdown_ns,
    ) == (410, 50, 0, 50, 50, 150)
    t = totals([s0, s1])
    assert t["comm_ms"] == pytest.approx(170e-6) and t["exposed_comm_ms"] == pytest.approx(130e-6)
    assert t["overlap_pct"] == pytest.approx(100 * 40 / 170) and t["wall_ms"] == pytest.approx(
        460e-6
    )
    st = find_straggler([s0, s1])
    assert (st.rank, st.slowest) == (1, 1) and st.ratio == pytest.approx(410 / 160)
    # its own slowdown spans name it (slept 150 of its 410 ns of compute), whatever the others did
    assert st.sentence.startswith(
        "rank 1 is the straggler: slowed on purpose, it slept 0.0 ms, "
        "1.6x its own compute, and computed 2.6x the median of the others"
    )


def test_parameter_server_roles_and_no_straggler_among_equals() -> None:
    events = [
        ev(0, "reply", 0, 10), ev(0, "apply", 30, 40),  # the server is never the straggler
        ev(1, "wait", 0, 5), ev(1, "pull", 5, 10), ev(1, "compute", 10, 30), ev(1, "push", 30, 35),
        ev(2, "wait", 0, 8), ev(2, "pull", 8, 12), ev(2, "compute", 12, 34), ev(2, "push", 34, 36),
    ]
    s0, s1, s2 = rank_stats(events)
    assert [s.role for s in (s0, s1, s2)] == ["server", "worker", "worker"]
    assert (s1.compute_ns, s1.comm_ns, s1.exposed_ns, s1.wait_ns, s1.overlap_pct) == (
        20,
        10,
        10,
        5,
        0.0,
    )
    assert (s0.compute_ns, s0.comm_ns) == (10, 10)
    st = find_straggler([s0, s1, s2])
    assert st.rank is None and st.slowest == 2 and st.ratio == pytest.approx(22 / 20)
    assert st.sentence.startswith("no straggler")
    assert find_straggler([s0, s1]).slowest is None  # one worker: nobody to compare with


def step(rank: int, kind: str, a: int, b: int, n: int, key: str = "step") -> Event:
    return Event(rank, kind, a, b, extra={key: n})


def test_one_preempted_step_makes_no_straggler_but_every_slow_step_does() -> None:
    """Rank 0 loses 50 units to the scheduler in one of three steps: its total is 2.9x rank 1's, its
    median step is not; rank 2 is slow in every step (the median step sees it)."""
    fast = [step(1, "forward", 10 * n, 10 * n + 2, n) for n in range(3)] + [
        step(1, "backward", 10 * n + 2, 10 * n + 10, n) for n in range(3)]
    hiccup = [
        step(0, "forward", 0, 60, 0),
        step(0, "forward", 100, 110, 1),
        step(0, "forward", 200, 210, 2),
    ]
    s0, s1 = rank_stats(hiccup + fast)
    assert (s0.compute_ns, s1.compute_ns) == (80, 30) and (
        s0.step_compute_ns,
        s1.step_compute_ns,
    ) == (10, 10)
    st = find_straggler([s0, s1])
    assert st.rank is None and st.ratio == 1.0 and "per step" in st.sentence
    slow = [step(2, "compute", 100 * n, 100 * n + 40, n, "clock") for n in range(3)]
    s2 = rank_stats(slow)[0]
    assert s2.step_compute_ns == 40
    st = find_straggler([s0, s1, s2])
    assert (st.rank, st.ratio) == (2, 4.0)


def test_totals_give_the_mean_per_rank_beside_the_sum() -> None:
    events = [ev(0, "forward", 0, 10), ev(0, "bucket", 10, 40, "comm"), ev(0, "wait", 10, 40),
              ev(1, "forward", 0, 20), ev(1, "bucket", 20, 30, "comm"), ev(1, "wait", 20, 30)]
    t = totals(rank_stats(events))
    assert t["ranks"] == 2
    assert (t["comm_ms"], t["exposed_comm_ms"], t["wait_ms"]) == pytest.approx(
        (40e-6, 40e-6, 40e-6)
    )
    assert (t["comm_mean_ms"], t["exposed_comm_mean_ms"], t["wait_mean_ms"]) == pytest.approx(
        (20e-6, 20e-6, 20e-6))
    assert t["compute_mean_ms"] == pytest.approx(15e-6) and t["wall_ms"] == pytest.approx(40e-6)


def four_ranks_rank0_slow() -> list:
    """Rank 0 computes 3 units a step, the others 1: slow enough to be named at 2x."""
    out = []
    for r in range(4):
        width = 3 if r == 0 else 1
        out += [step(r, "forward", 10 * n, 10 * n + width, n) for n in range(3)]
    return rank_stats(out)


def test_a_slow_rank_nobody_configured_is_the_machines_doing() -> None:
    stats = four_ranks_rank0_slow()
    st = find_straggler(stats, configured=(), cores=2)
    assert (st.rank, st.configured, st.ratio) == (0, False, 3.0)
    assert st.sentence.startswith("rank 0 is the slowest, 3.0x the median compute per step of the "
                                  "others")
    assert "is the straggler" not in st.sentence
    assert st.sentence.endswith("But no straggler was configured: this is the machine's doing (4 "
                                "ranks sharing 2 CPU cores: the operating system gave this one "
                                "less time), not a configured straggler")
    roomy = find_straggler(stats, configured=(), cores=16).sentence
    assert "other work on the machine's 16 CPU cores slowed it" in roomy
    # cores unknown
    assert "sharing the machine's cores" in find_straggler(stats, configured=()).sentence
    other = find_straggler(stats, configured=(2,), cores=2)
    assert (
        other.configured is False and "But the configured straggler is rank 2: " in other.sentence
    )


def test_a_configured_straggler_is_named_as_before() -> None:
    stats = four_ranks_rank0_slow()
    for configured, flag in (((0,), True), (None, None)):
        st = find_straggler(stats, configured=configured, cores=2)
        assert (st.rank, st.configured) == (0, flag)
        assert st.sentence.startswith("rank 0 is the straggler: 3.0x the median compute per step")
        assert "machine" not in st.sentence


def test_configured_stragglers_from_the_row() -> None:
    assert configured_stragglers({"straggler": "none"}) == ()
    assert configured_stragglers({"straggler": "1:4"}) == (1,)
    assert configured_stragglers({"straggler": "0:2,3:4.5"}) == (0, 3)
    assert configured_stragglers({}) is None and configured_stragglers({"straggler": "x:y"}) is None


def test_a_straggler_whose_sleep_overshot_once_is_still_named() -> None:
    """Rank 1 slept its whole debt in step 0 (one sleep that overshot is paid back by the next
    steps), so its median step looks like rank 0's; its slowdown spans still name it. Before, the
    median-step rule said "no straggler" for a configured 8x straggler about 1 run in 5 here."""
    def step(rank: int, k: int, compute: int, slept: int = 0) -> list[Event]:
        t = 1000 * k
        evs = [Event(rank, "forward", t, t + compute + slept, extra={"step": k})]
        return evs + ([Event(rank, "slowdown", t, t + slept, extra={"step": k})] if slept else [])

    events = [e for k in range(5) for e in step(0, k, 100)]
    events += [e for k in range(5) for e in step(1, k, 100, slept=700 if k == 0 else 0)]
    s0, s1 = rank_stats(events)
    assert s0.step_compute_ns == s1.step_compute_ns == 100  # the median step: no difference
    st = find_straggler([s0, s1], configured=(1,), cores=2)
    assert (st.rank, st.configured) == (1, True) and st.ratio == pytest.approx(1200 / 500)
    assert st.sentence.startswith("rank 1 is the straggler: slowed on purpose, it slept 0.0 ms")
