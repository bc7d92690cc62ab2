"""The default ``dplab train --trace`` shows what the bucket docstrings promise: several buckets,
the first one's all-reduce under way while backward still computes the earlier layers."""

from __future__ import annotations

from collections import defaultdict

from dplab.backends.cli.args import TRAIN_BUCKET_CAP_MB
from dplab.backends.cli.commands import main
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.trace import load_json
from dplab.reference.train.buckets import assign_buckets


def test_default_mlp_falls_in_one_bucket_per_layer_in_either_dtype():
    model = MLP(MLPConfig(16, (32, 32), 4, "tanh", "mse"))
    for itemsize in (8, 4):  # float64, float32
        assert assign_buckets(model.param_slices, itemsize, TRAIN_BUCKET_CAP_MB) == [
            [5, 4],
            [3, 2],
            [1, 0],
        ]
        # DDP's 25 MB
        assert assign_buckets(model.param_slices, itemsize, 25.0) == [[5, 4, 3, 2, 1, 0]]


def test_default_train_trace_overlaps_the_first_bucket_with_backward(tmp_path, capsys):
    trace = tmp_path / "run.json"
    assert main(["train", "--trace", str(trace)]) == 0  # every other option at its default
    events, meta = load_json(trace)
    assert meta["row"]["world_size"] == 4 and meta["row"]["steps"] == 50
    assert meta["row"]["max_abs_diff_vs_single"] < 1e-12
    by_rank: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for e in sorted(events, key=lambda e: e.t_start_ns):
        by_rank[e.rank][e.kind].append(e)
    overlapped = 0
    for rank in range(4):
        buckets, backwards = by_rank[rank]["bucket"], by_rank[rank]["backward"]
        assert len(backwards) == 50 and len(buckets) == 150  # 3 buckets a step
        assert [b.extra["bucket"] for b in buckets] == [0, 1, 2] * 50
        # last layer first: W2+b2, W1+b1, W0+b0 of the 16-32-32-4 MLP in float64
        assert [b.bytes for b in buckets[:3]] == [(128 + 4) * 8, (1024 + 32) * 8, (512 + 32) * 8]
        assert all(b.thread == "comm" for b in buckets)
        for step, backward in enumerate(backwards):
            first = buckets[3 * step]
            assert first.t_start_ns >= backward.t_start_ns  # launched by this step's backward
            overlapped += first.t_start_ns < backward.t_end_ns
    # Measured here: 30-50% of the 200 rank-steps (the comm thread needs the GIL the main thread
    # holds while it computes); with DDP's 25 MB cap, one bucket after backward: none.
    assert overlapped >= 1, "no step's first bucket started before its backward ended"
