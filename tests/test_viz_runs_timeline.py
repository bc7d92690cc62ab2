"""The Runs page's timeline: lanes and spans of real small runs, trace files in and out."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from dplab.backends.runs.run import RunSpec, run_train  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.trace import Event, merge  # noqa: E402
from dplab.reference.train.single import TrainConfig  # noqa: E402
from dplab.viz.timeline import chrome_bytes, lanes, load_trace, spans, timeline_figure, trace_bytes  # noqa: E402
from dplab.viz.timeline_metrics import rank_stats  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def sync_run() -> list[Event]:
    """3 ranks, ring, one bucket per layer of the default MLP (3 layers: 3 buckets per step)."""
    _, per_rank = run_train(
        RunSpec(world_size=3, bucket_cap_mb=0.0005, train=TrainConfig(steps=STEPS)), trace=True
    )
    return merge(per_rank)


def test_sync_run_lanes_and_spans(sync_run: list[Event]) -> None:
    assert lanes(sync_run) == [f"rank {r} · {t}" for r in range(3) for t in ("main", "comm")]
    top = spans(sync_run)
    count = Counter((s.lane, s.kind) for s in top)
    for r in range(3):
        main, comm = f"rank {r} · main", f"rank {r} · comm"
        for kind in ("forward", "backward", "wait", "optimizer"):
            assert count[(main, kind)] == STEPS
        assert count[(main, "allreduce")] == STEPS  # the loss, once per step
        assert count[(main, "broadcast")] == 1  # rank 0's parameters at start-up
        assert count[(comm, "bucket")] == 3 * STEPS  # each bucket's all-reduce, every step
        # its all-reduce and sends nest
        assert {k for (lane, k) in count if lane == comm} == {"bucket"}
        buckets = [s for s in top if s.lane == comm and s.kind == "bucket"]
        assert [s.event.extra["bucket"] for s in buckets] == [0, 1, 2] * STEPS
    assert all(s.depth == 0 for s in top)
    deep = spans(sync_run, detail=True)
    assert len(deep) == len(sync_run)  # detail: every event is a bar
    depth = {(s.lane, s.kind): s.depth for s in deep if "comm" in s.lane}
    assert depth[("rank 0 · comm", "allreduce")] == 1 and depth[("rank 0 · comm", "send")] == 2


def test_figure_is_horizontal_bars_with_base(sync_run: list[Event]) -> None:
    fig = timeline_figure(sync_run)
    t0 = min(e.t_start_ns for e in sync_run)
    fwd = next(t for t in fig.data if t.name == "forward")
    assert fwd.type == "bar" and fwd.orientation == "h" and len(fwd.x) == 3 * STEPS
    first = min((e for e in sync_run if e.kind == "forward"), key=lambda e: e.t_start_ns)
    i = list(fwd.base).index(min(fwd.base))
    assert fwd.base[i] == pytest.approx((first.t_start_ns - t0) / 1e6)
    assert fwd.x[i] == pytest.approx((first.t_end_ns - first.t_start_ns) / 1e6)
    assert list(fig.layout.yaxis.categoryarray) == lanes(sync_run)
    assert [t.name for t in fig.data][:4] == ["forward", "backward", "optimizer", "wait"]


def test_async_lanes_spans_and_straggler() -> None:
    _, per_rank = run_train(
        RunSpec(
            world_size=3,
            mode="async",
            staleness=1,
            train=TrainConfig(steps=STEPS),
            straggler=((2, 4.0),),
        ),
        trace=True,
    )
    events = merge(per_rank)
    assert lanes(events) == ["rank 0 · main", "rank 1 · main", "rank 2 · main"]
    count = Counter((s.lane, s.kind) for s in spans(events))
    for r in (1, 2):
        for kind in ("wait", "pull", "compute", "push"):
            assert count[(f"rank {r} · main", kind)] == STEPS
    assert (
        count[("rank 0 · main", "apply")] == 2 * STEPS
        and count[("rank 0 · main", "reply")] == 2 * STEPS
    )
    assert count[("rank 2 · main", "slowdown")] >= 1  # nested in compute, drawn anyway
    stats = rank_stats(events)
    assert [s.role for s in stats] == ["server", "worker", "worker"]
    assert stats[2].slowdown_ns > 0 and stats[1].slowdown_ns == 0


def test_trace_file_round_trip_and_chrome(sync_run: list[Event], tmp_path) -> None:
    events, meta = load_trace(trace_bytes(sync_run, {"row": {"world_size": 3}}))
    assert events == sync_run and meta == {"row": {"world_size": 3}}
    chrome = json.loads(chrome_bytes(sync_run))
    xs = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(sync_run)
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"main", "comm"}
    with pytest.raises(ConfigError, match="not its .chrome.json"):
        load_trace(chrome_bytes(sync_run))
    with pytest.raises(ConfigError, match="not a dplab trace"):
        load_trace(b"{nope")
    with pytest.raises(ConfigError, match="no events"):
        load_trace(b'{"events": []}')
