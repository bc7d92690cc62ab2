"""``dplab scaling``: the step split adds up, efficiency at p = 1 is 1, bad arguments exit 2, rows'
fields."""

from __future__ import annotations

import json

import pytest

from dplab.backends.cli.commands import main
from dplab.backends.cli.scaling import MODELS, SCALING_COLUMNS, scaling_rows
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLP
from dplab.reference.trace import Event
from dplab.reference.trace_metrics import step_split

MS = 1_000_000  # ns


def _ev(kind: str, a: float, b: float, step: int | None = None, thread: str = "main") -> Event:
    extra = {} if step is None else {"step": step}
    return Event(0, kind, int(a * MS), int(b * MS), thread=thread, extra=extra)


def test_step_split_is_disjoint_and_adds_up_to_the_step():
    # step 0 (warm-up) is left out; steps 1 and 2 each 10 ms:
    #   forward 1 ms, backward 4 ms; a bucket 3-8 ms (2 ms under backward, 3 exposed); wait 5-9 ms
    #   (3 of it under the bucket, 1 ms waiting with nothing moving); optimizer 9-9.5; 0.5 ms other
    evs = [_ev("forward", 0, 5, 0), _ev("optimizer", 5, 10, 0)]
    for s in (1, 2):
        t = 10 * s
        evs += [
            _ev("forward", t, t + 1, s),
            _ev("backward", t + 1, t + 5, s),
            _ev("bucket", t + 3, t + 8, thread="comm"),
            _ev("send", t + 3.5, t + 4, thread="comm"),
            _ev("wait", t + 5, t + 9, s),
            _ev("optimizer", t + 9, t + 9.5, s),
        ]
    split = step_split(evs, first_step=1)
    assert split.steps == 2
    assert split.step_ms == pytest.approx((29.5 - 10) / 2)
    assert split.compute_ms == pytest.approx(5.5)
    assert split.exposed_comm_ms == pytest.approx(3.0)
    assert split.waiting_ms == pytest.approx(1.0)
    assert split.other_ms == pytest.approx(split.step_ms - 5.5 - 3.0 - 1.0)
    with pytest.raises(ConfigError, match="no forward span of step 3"):
        step_split(evs, first_step=3)


def test_efficiency_at_one_rank_is_one_and_speedup_is_t1_over_tp():
    def cell(t: float) -> dict:
        return {
            "step_ms": t,
            "compute_ms": t,
            "exposed_comm_ms": 0.0,
            "waiting_ms": 0.0,
            "other_ms": 0.0,
        }

    rows = scaling_rows({("local", "small", 1): [cell(10.0), cell(12.0), cell(11.0)],
                         ("local", "small", 4): [cell(5.0), cell(4.0), cell(6.0)],
                         ("mpi", "small", 2): [cell(8.0)]})
    by = {(r["backend"], r["world_size"]): r for r in rows}
    # the median rep
    assert by["local", 1]["step_ms"] == 11.0 and by["local", 1]["efficiency"] == 1.0
    assert by["local", 1]["speedup"] == 1.0
    assert by["local", 4]["speedup"] == pytest.approx(11 / 5)
    assert by["local", 4]["efficiency"] == pytest.approx(11 / 20)
    # no p = 1 to divide by
    assert by["mpi", 2]["speedup"] is None and by["mpi", 2]["efficiency"] is None
    assert by["local", 4]["params"] == MLP(MODELS["small"]).num_params == 1732


@pytest.mark.parametrize("argv, says", [
    (["--steps", "2", "--warmup", "2"], "--steps > --warmup"),
    (["--models", "huge"], "unknown model 'huge'"),
    (["--world-sizes", "0"], "world sizes must be >= 1"),
    (["--world-sizes", "4", "--global-batch", "2"], "--global-batch 2 is less than world size 4"),
    (["--backends", "nosuch"], "nosuch"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0"),
    (["--algorithm", "nosuch"], "unknown algorithm 'nosuch'"),
    (["--ddp", "--steps", "1", "--warmup", "1"], "--steps > --warmup"),
    (["--world-sizes", "x"], "bad list"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys):
    try:
        code = main(["scaling", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert says in err and err.count("\n") == 1, err


def test_a_tiny_run_has_every_field_and_its_split_adds_up(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    assert (
        main(
            [
                "scaling",
                "--models",
                "small",
                "--world-sizes",
                "1,2",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--reps",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert all(c in table for c in SCALING_COLUMNS)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["world_size"]) for r in rows] == [("small", 1), ("small", 2)]
    for r in rows:
        assert set(SCALING_COLUMNS) <= set(r)
        assert (
            r["step_ms"] > 0
            and r["compute_ms"] > 0
            and min(r["exposed_comm_ms"], r["waiting_ms"]) >= 0
        )
        parts = r["compute_ms"] + r["exposed_comm_ms"] + r["waiting_ms"] + r["other_ms"]
        assert parts == pytest.approx(r["step_ms"], rel=1e-9)
        assert r["speedup"] == pytest.approx(rows[0]["step_ms"] / r["step_ms"])
    assert rows[0]["efficiency"] == 1.0
    assert rows[1]["exposed_comm_ms"] > 0  # two ranks all-reduce; one does not need to


def test_every_option_shows_its_default():
    import re

    from dplab.backends.cli.args import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and hasattr(a, "_name_parser_map")]
    options = sub.choices["scaling"].format_help().split("options:", 1)[1].split("columns (", 1)[0]
    blocks = re.split(r"\n  (?=--)", options)[1:]  # one block per option, its help lines included
    assert len(blocks) == 14  # --cluster included
    for block in blocks:
        assert "default" in block, block
