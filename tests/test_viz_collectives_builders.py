"""The Collectives page's builders: every frame, arrow, value, word and counter comes from the
schedule."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the viz extra is not installed: pip install 'dplab[viz]'")
import plotly.graph_objects as go  # noqa: E402

from dplab.reference.algorithms import ALLREDUCE, ROOTED, SCATTER, allreduce_schedule  # noqa: E402
from dplab.reference.collectives import schedule_plan  # noqa: E402
from dplab.reference.costmodel import closed_form, cost  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.viz.collectives import (  # noqa: E402
    COLLECTIVES,
    MAX_CLAUSES,
    CollectiveConfig,
    algorithms_for,
    contributors_label,
    walkthrough,
)
from dplab.viz.collectives_figure import BUTTONS_PX, PLAY_MS, arrows, at_frame, figure, figure_spec  # noqa: E402

CASES = [(c, a) for c in COLLECTIVES for a in algorithms_for(c)]


def test_algorithms_are_the_executors():
    assert algorithms_for("allreduce")[:4] == ["naive", "ring", "tree", "direct"]  # then the others
    assert algorithms_for("allreduce") == list(ALLREDUCE)
    assert algorithms_for("reduce_scatter") == list(SCATTER) == algorithms_for("allgather")
    assert algorithms_for("broadcast") == sorted(ROOTED) == algorithms_for("reduce")


def _order(t):
    return (t.src, t.dst, t.chunk, t.op)


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_frames_arrows_and_provenance_for_every_world_size(collective, algorithm):
    """frames = rounds + 1; frame k's arrows are rounds[k]; the end is what the collective
    leaves."""
    for p in range(1, 17):
        root = p // 2
        w = walkthrough(CollectiveConfig(collective, algorithm, p, n=2 * p + 1, root=root))
        sched = schedule_plan(collective, algorithm, p, 0, root)[0]
        assert w.schedule == sched  # the schedule the executor runs, transfer for transfer
        assert len(w.frames) == len(sched.rounds) + 1
        spec = figure_spec(w)
        assert len(spec["frames"]) == len(w.frames)
        for k, frame in enumerate(spec["frames"]):
            # a round is a set
            want = sorted(sched.rounds[k], key=_order) if k < len(sched.rounds) else []
            drawn = sorted(arrows(frame["layout"]), key=_order)
            assert drawn == want == sorted(w.frames[k].transfers, key=_order)
        assert w.correct, (collective, algorithm, p)
        final = w.frames[-1]
        if collective == "allreduce":
            assert (final.holdings == 1).all() and final.done.all()
        if collective == "allgather":
            assert (final.holdings == np.eye(p, dtype=int)[None, :, :]).all()  # chunk c: rank c's
        if collective == "reduce":
            assert (final.holdings[root] == 1).all() and final.done[root].all()
        if collective == "broadcast":
            assert (
                final.holdings[:, :, root] == 1
            ).all() and final.holdings.sum() == p * sched.num_chunks


@pytest.mark.parametrize("algorithm", algorithms_for("allreduce"))
@pytest.mark.parametrize("p,n", [(1, 5), (2, 0), (3, 1), (5, 13), (7, 3), (16, 37)])
def test_last_frame_values_are_the_sum_on_every_rank(algorithm, p, n):
    w = walkthrough(CollectiveConfig("allreduce", algorithm, p, n, seed=p + n))
    total = np.sum(w.inputs, axis=0)
    for r in range(p):
        np.testing.assert_array_equal(w.frames[-1].values[r], total)
        np.testing.assert_array_equal(w.final_values[r], total)  # simulate() on the whole schedule
    # every frame's values are what its provenance says: contributions weighted by their counts,
    # every rank and chunk at once (small integers: the products and sums are exact)
    inputs = np.asarray(w.inputs, dtype=float).reshape(p, n)
    for f in w.frames:
        expect = np.zeros((p, n))
        for c, (a, b) in enumerate(_bounds(n, w.schedule.num_chunks)):
            expect[:, a:b] = f.holdings[:, c, :] @ inputs[:, a:b]  # [r, j] counts x rank j's
        np.testing.assert_array_equal(np.asarray(f.values, dtype=float).reshape(p, n), expect)
    assert all(float(v).is_integer() and 0 <= v <= 9 for x in w.inputs for v in x)  # small integers


def _bounds(n, k):
    from dplab.reference.schedule import chunk_bounds
    return chunk_bounds(n, k)


def test_long_vectors_skip_values_but_keep_provenance():
    w = walkthrough(CollectiveConfig("allreduce", "ring", 4, n=10_000))
    assert w.frames[0].values is None and w.correct
    assert (
        "shown for vectors of up to 256"
        in figure_spec(w)["frames"][0]["data"][0]["customdata"][0][0]
    )


def test_sentences_and_phases_in_words():
    w = walkthrough(CollectiveConfig("allreduce", "ring", 4, 8))
    assert [f.phase for f in w.frames] == ["reduce-scatter"] * 3 + ["all-gather"] * 3 + ["done"]
    assert w.frames[2].sentence == (
        "round 3 of 6, reduce-scatter: rank 0 sends chunk 1 to rank 1, which adds it; rank 1 sends "
        "chunk 2 to rank 2, which adds it; rank 2 sends chunk 3 to rank 3, which adds it; rank 3 "
        "sends chunk 0 to rank 0, which adds it")
    assert w.frames[3].sentence.startswith("round 4 of 6, all-gather: rank 0 sends chunk 0 to rank "
                                           "1, which copies it;")
    assert w.frames[-1].sentence == ("done after 6 rounds: every rank holds every chunk summed "
                                     "over all 4 ranks, each contribution exactly once")
    tree = walkthrough(CollectiveConfig("allreduce", "tree", 6, 8))
    assert [f.phase for f in tree.frames[:-1]] == ["reduce up the tree"] * 3 + ["broadcast down "
                                                                                "the tree"] * 3
    assert tree.frames[1].sentence == ("round 2 of 6, reduce up the tree: rank 2 sends its whole "
                                       "buffer to rank 0, which adds it")
    naive = walkthrough(CollectiveConfig("allreduce", "naive", 3, 8))
    assert [f.phase for f in naive.frames[:-1]] == ["reduce to the root", "broadcast from the root"]
    big = walkthrough(CollectiveConfig("allreduce", "ring", 16, 8)).frames[0].sentence
    assert big.count("which adds it") == MAX_CLAUSES and big.endswith("and 12 more transfers like "
                                                                      "these, all at once")
    assert (
        walkthrough(CollectiveConfig("allreduce", "ring", 1, 8))
        .frames[0]
        .sentence.startswith("no rounds")
    )


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_bytes_and_time_counters_match_the_closed_forms(collective, algorithm):
    for p in (2, 3, 4, 8, 16):
        cfg = CollectiveConfig(
            collective, algorithm, p, n=p * 6, alpha_us=3.0, beta_gbps=2.0, gamma_gbps=4.0
        )
        w = walkthrough(cfg)
        sent = [f.bytes_sent for f in w.frames]
        assert sent[0] == (0,) * p
        assert all(a <= b for before, after in zip(sent, sent[1:]) for a, b in zip(before, after))
        if algorithm == "hierarchical" and p % 2:  # a smaller last node: no textbook form
            assert w.closed_form_bytes is None
        else:
            assert max(sent[-1]) == w.closed_form_bytes
        whole = cost(w.schedule, cfg.nbytes, *cfg.abg, cfg.itemsize)
        assert w.frames[-1].time_s == pytest.approx(whole.time, rel=1e-12)
        assert max(sent[-1]) == whole.bytes_sent_max
        if collective == "allreduce" and algorithm == "ring":
            assert w.closed_form_time_s == pytest.approx(
                closed_form("ring", p, cfg.nbytes, *cfg.abg)
            )
            assert w.frames[-1].time_s == pytest.approx(w.closed_form_time_s, rel=1e-12)


def test_contributors_label():
    assert contributors_label(np.array([1, 1, 1, 1])) == "0-3"
    assert contributors_label(np.array([1, 0, 1, 1])) == "0,2,3"
    assert contributors_label(np.array([1, 1, 0, 0, 0, 1, 1, 1])) == "0,1,5-7"
    assert contributors_label(np.array([0, 2, 1, 1])) == "1×2,2,3"  # double counting shows
    assert contributors_label(np.zeros(3, dtype=int)) == "-"


def test_bad_configurations_say_what_to_choose():
    with pytest.raises(ConfigError, match="choose one of ring, direct"):
        CollectiveConfig("reduce_scatter", "tree")
    with pytest.raises(ConfigError, match="root must be a rank 0..3"):
        CollectiveConfig("broadcast", "tree", 4, root=4)
    with pytest.raises(ConfigError, match="collective must be one of"):
        CollectiveConfig("alltoall", "ring")
    with pytest.raises(ConfigError, match="beta_gbps must be"):
        CollectiveConfig(beta_gbps=float("nan"))


def test_figure_is_a_valid_plotly_animation_with_client_side_play():
    w = walkthrough(CollectiveConfig("allreduce", "ring", 4, 8))
    fig = figure(w, start=2)
    go.Figure(fig.to_dict())  # plotly's full validation (the builder skips it for speed)
    slider = fig.layout.sliders[0]
    assert slider.active == 2 and [list(s.args[0]) for s in slider.steps] == [
        [str(i)] for i in range(7)
    ]
    play = fig.layout.updatemenus[0].buttons[0]
    assert play.method == "animate" and play.args[1]["frame"] == {
        "duration": PLAY_MS,
        "redraw": True,
    }
    assert play.args[1]["fromcurrent"] is True
    # the buttons sit left of the rail, which starts BUTTONS_PX (pixels) in;
    # the "frame N" label sits at the rail's right end, so Play/Pause cannot cover it (they did:
    # "frame 1" read "me 1")
    menu = fig.layout.updatemenus[0]
    assert (menu.x, menu.xanchor, menu.y, slider.x, slider.y) == (
        0.0,
        "left",
        slider.y,
        0.0,
        menu.y,
    )
    assert slider.pad.l == BUTTONS_PX and slider.currentvalue.xanchor == "right"
    assert [b.label for b in menu.buttons] == ["▶ Play", "Pause"]
    # the shown frame's arrows
    assert arrows(fig.layout) == list(allreduce_schedule("ring", 4).rounds[2])
    heat = fig.data[0]
    # rank 0 before round 3: round 1 brought chunk 2 from rank 3, round 2 chunk 1 (already 2+3)
    assert list(heat.z[0]) == [1, 3, 2, 1]
    assert list(heat.text[0]) == ["0", "0,2,3", "0,3", "0"]
    assert (
        "round 3 of 6: reduce-scatter" in fig.layout.title.text
        and "closed form" in fig.layout.title.text
    )
    assert at_frame(figure_spec(w), 99).layout.sliders[0].active == 6  # clamped to the end
    assert at_frame(figure_spec(w), 99).layout.annotations == ()
