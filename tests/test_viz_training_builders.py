"""The Training page's builders on real small runs: the curves are the runs', the counts the
log's."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("plotly", reason="needs plotly: pip install 'dplab[viz]'")

from dplab.backends.runs.grid import compare_specs  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.reference.ps.replay import replay  # noqa: E402
from dplab.reference.train.single import evaluate, train_single  # noqa: E402
from dplab.viz.training import (  # noqa: E402
    RELATIVE_TOL,
    X_TITLES,
    delay_counts,
    delay_figure,
    equivalence_figure,
    loss_figure,
    short_label,
    straggler_cost,
    summary_rows,
    throughput_figure,
    tolerance,
)
from dplab.viz.training_runs import Cell, TrainingGrid, fill_sync, run_grid  # noqa: E402

GRID = TrainingGrid(world_size=3, steps=4, staleness=(0, None), backup_workers=(1,), hidden=(8,),
                    num_samples=128, global_batch=32, straggler_factor=2.0, points=3)


@pytest.fixture(scope="module")
def cells() -> list[Cell]:
    return run_grid(GRID)


def test_grid_is_compare_specs_without_then_with_the_straggler(cells: list[Cell]) -> None:
    labels = [(c.label, c.straggler) for c in cells]
    runs = ("ring", "ps backup b=1", "ps s=0", "ps s=inf")
    assert labels == [(lab, s) for s in ("none", "2:2") for lab in runs]
    base = GRID.specs()[0]
    assert GRID.specs()[:4] == compare_specs(
        base, ["local"], [3], ["sync", "backup", "async"], ["ring"], [0, None], [1]
    )


def test_every_curve_ends_on_its_rows_final_loss(cells: list[Cell]) -> None:
    for c in cells:
        assert len(c.steps) == len(c.times_s) == len(c.losses)
        assert c.losses[-1] == c.row["final_loss"]  # the same number, not a close one
        assert c.losses[0] == evaluate(
            GRID.train_config(), train_single(replace(GRID.train_config(), steps=0)).params
        )
        assert c.times_s == sorted(c.times_s) and c.times_s[-1] <= c.row["wall_s"] + 0.05
        assert c.steps[-1] == pytest.approx(c.row["samples"] / GRID.global_batch)


def test_sync_per_step_losses_and_diffs_are_one_devices_to_rounding(cells: list[Cell]) -> None:
    cfg = GRID.train_config()
    for c in (c for c in cells if c.row["mode"] == "sync"):
        assert c.same_bits is True and len(c.diffs) == GRID.steps
        assert max(c.diffs) < 1e-12 and c.diffs[-1] == c.row["max_abs_diff_vs_single"]
        single = [
            evaluate(cfg, train_single(replace(cfg, steps=k)).params) for k in range(GRID.steps + 1)
        ]
        assert np.allclose(c.losses, single, rtol=1e-12, atol=0)
        assert c.steps == [float(k) for k in range(GRID.steps + 1)]


def test_server_curves_replay_the_log(cells: list[Cell]) -> None:
    for c in (c for c in cells if c.row["mode"] != "sync"):
        assert c.row["replay_exact"] is True
        again = replay(c.spec.train, c.spec.async_config(), c.log, GRID.world_size - 1)
        assert np.array_equal(again, c.params)
        assert 1 + min(GRID.points, c.row["updates"]) >= len(c.losses) >= 2


def test_delay_histogram_counts_are_the_logs(cells: list[Cell]) -> None:
    fig = delay_figure(cells)
    bars = {(t.name, t.xaxis): dict(zip(t.x, t.y)) for t in fig.data}
    ps = [c for c in cells if c.row["mode"] != "sync"]
    assert len(fig.data) == len(ps)
    for c in ps:
        counts = delay_counts(c)
        assert counts == dict(sorted(Counter(e.produced - 1 - e.version for e in c.log).items()))
        assert sum(counts.values()) == len(c.log) and max(counts) == c.row["max_delay"]
        axis = "x" if c.straggler == "none" else "x2"
        name = c.label if c.straggler == "none" else f"{c.label} · straggler {c.straggler}"
        assert bars[(name, axis)] == counts
    assert (
        "updates" in fig.layout.xaxis.title.text
        and "staleness bounds clocks" in fig.layout.title.text
    )


def test_loss_throughput_and_equivalence_figures_carry_the_cells_values(cells: list[Cell]) -> None:
    by_steps, by_time = loss_figure(cells, "step"), loss_figure(cells, "time")
    assert [list(t.y) for t in by_steps.data] == [c.losses for c in cells]
    assert [list(t.x) for t in by_time.data] == [c.times_s for c in cells]
    assert [t.line.dash for t in by_steps.data] == ["solid"] * 4 + ["dot"] * 4
    with pytest.raises(ValueError, match="x must be one of"):
        loss_figure(cells, "clock")
    tp = throughput_figure(cells)
    assert [list(t.y) for t in tp.data] == [[c.row["samples_per_s"] for c in cells[:4]],
                                            [c.row["samples_per_s"] for c in cells[4:]]]
    eq = equivalence_figure(cells)
    assert (
        len(eq.data) == 1 and list(eq.data[0].y) == cells[0].diffs and eq.layout.yaxis.type == "log"
    )
    assert by_steps.layout.xaxis.title.text == X_TITLES["step"] and len(X_TITLES["step"]) <= 40
    rows = summary_rows(cells)
    assert [r["final_loss"] for r in rows] == [c.row["final_loss"] for c in cells]
    assert all(r["exact"] is True for r in rows)


def test_straggler_cost_is_the_throughput_ratio() -> None:
    def cell(label: str, straggler: str, sps: float) -> Cell:
        return Cell(
            None,
            {"algorithm": label, "straggler": straggler, "samples_per_s": sps, "mode": "sync"},
            [],
            [],
            [],
        )
    cost = straggler_cost([cell("ring", "none", 100.0), cell("ps s=0", "none", 50.0),
                           cell("ring", "3:8", 25.0), cell("ps s=0", "3:8", 75.0)])
    assert cost == {"ring": 0.25, "ps s=0": 1.5}


def test_a_sync_run_on_other_bits_is_refused(cells: list[Cell]) -> None:
    sync = replace(cells[0], params=cells[0].params + np.finfo(float).eps, losses=[0.0])
    steps = [cells[0].params] * GRID.steps
    with pytest.raises(ConfigError, match="other bits"):
        fill_sync([sync], steps, GRID.train_config())
    with pytest.raises(ConfigError, match="checkpoints"):
        fill_sync([sync], steps[:-1], GRID.train_config())


def test_grid_refuses_worlds_without_a_straggling_worker() -> None:
    with pytest.raises(ConfigError, match="world_size >= 3"):
        TrainingGrid(world_size=2).specs()
    with pytest.raises(ConfigError, match="straggler_factor"):
        TrainingGrid(straggler_factor=0.5).specs()


def test_equivalence_axis_spans_the_rounding_up_past_the_tolerance_line(cells: list[Cell]) -> None:
    """Rounding-level differences read as rounding: the log axis runs from a decade below the
    smallest difference to a decade above the tolerance, which is drawn, not squeezed between two
    ~1e-16 values."""
    sync = cells[0]
    scale = max(1.0, float(np.max(np.abs(sync.params))))
    assert tolerance(cells) == RELATIVE_TOL * scale
    eq = equivalence_figure(cells)
    (line,) = eq.layout.shapes
    assert line.y0 == line.y1 == tolerance(cells) and line.line.dash == "dash"
    (label,) = eq.layout.annotations
    # log axis: exponent
    assert label.y == np.log10(tolerance(cells)) and label.text.startswith("tolerance")
    low, high = eq.layout.yaxis.range
    smallest = min(d for d in sync.diffs if d > 0)
    assert (
        low == np.floor(np.log10(smallest)) - 1 and high == np.ceil(np.log10(tolerance(cells))) + 1
    )
    assert high - low >= 6  # ~1e-16 against 1e-10: at least six decades on screen
    assert max(sync.diffs) < tolerance(cells) * 1e-3


def test_metric_labels_are_short() -> None:
    assert [short_label(lab) for lab in ("ring", "ps backup b=1", "ps s=0", "ps s=inf")] == \
        ["ring", "backup b=1", "s=0", "s=inf"]
