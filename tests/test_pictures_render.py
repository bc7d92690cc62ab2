"""The text renderer itself: values of what it draws, its refusals, its determinism."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dplab.reference import pictures
from dplab.reference.algorithms import ALLREDUCE, direct, ring, tree
from dplab.reference.pictures import (
    PictureError,
    contents,
    render_arrows,
    render_rounds,
    render_timeline,
    render_tree,
)
from dplab.reference.schedule import Schedule, Transfer
from dplab.reference.trace import Event


def test_pictures_module_doctest() -> None:
    assert doctest.testmod(pictures).failed == 0


def test_pictures_contents_shows_double_counting() -> None:
    assert contents(1, np.array([2, 1, 0])) == "b001"
    assert contents(0, np.array([0, 0])) == "a"


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(ALLREDUCE)), st.integers(1, 8))
def test_pictures_every_allreduce_ends_complete(algorithm: str, p: int) -> None:
    s = ALLREDUCE[algorithm](p)
    assume(s.num_chunks <= 26)  # the text names chunks a..z; more is refused (tested below)
    text = render_rounds(s)
    full = [pictures._chunk_name(c) + "".join(map(str, range(p))) for c in range(s.num_chunks)]
    if s.rounds:
        tail = text.splitlines()[-p:]
        assert tail == [f"  r{r} [{' '.join(full)}]" for r in range(p)]
    # one arrow per (rank, chunk, op) a round sends, one destination per transfer
    arrows = sum(len({(t.src, t.chunk, t.op) for t in rnd}) for rnd in s.rounds)
    body = "\n".join(line for line in text.splitlines() if line.startswith("  r"))
    assert body.count("--> ") + body.count("==> ") == arrows
    assert render_rounds(s) == text  # a pure function of the schedule


def test_pictures_a_double_count_is_drawn() -> None:
    bad = Schedule("twice", 2, 1, ((Transfer(1, 0, 0, "reduce"),), (Transfer(1, 0, 0, "reduce"),)))
    assert render_rounds(bad).splitlines()[-2:] == ["  r0 [a011]", "  r1 [a1]"]


def test_pictures_rounds_subset_and_empty() -> None:
    text = render_rounds(ring.allreduce(3), rounds=[2])
    assert text.splitlines()[2:] == [
        "round 2",
        "  r0 [a012 b02  c0]    ==a012==> r1",
        "  r1 [a1   b012 c01]   ==b012==> r2",
        "  r2 [a12  b2   c012]  ==c012==> r0",
        "after round 2",
        "  r0 [a012 b02  c012]",
        "  r1 [a012 b012 c01]",
        "  r2 [a12  b012 c012]",
    ]
    assert "round" not in render_rounds(ring.allreduce(1)).split("\n", 1)[1].replace("==x==>", "")


def test_pictures_refuses_what_the_notation_cannot_draw() -> None:
    with pytest.raises(PictureError, match="at most 10 ranks"):
        render_rounds(ring.allreduce(11))
    with pytest.raises(PictureError, match="a..z"):
        render_arrows(ring.allreduce(27))


def test_pictures_arrows_and_tree() -> None:
    assert render_arrows(direct.allgather(2)) == "round 0 (copies):  0-a->1   1-b->0"
    assert render_tree(tree.reduce(8)).splitlines() == ["0 <- 1", "0 <- 2 <- 3", "0 <- 4 <- 5",
                                                        "0 <- 4 <- 6 <- 7"]
    assert render_tree(tree.reduce(1)) == ""


def ev(kind: str, t0: int, t1: int, lane: str = "main", label: str | None = None) -> Event:
    return Event(0, kind, t0, t1, thread=lane, extra={"label": label or kind})


def test_pictures_timeline_columns() -> None:
    text = render_timeline(
        [
            ev("a", 0, 400, label="alpha"),
            ev("b", 400, 600),
            ev("c", 150, 450, "comm"),
            ev("m", 650, 650, "comm"),
        ],
        50,
        lane=lambda e: e.thread,
        marks={"m": "^"},
        tick_every=5,
    )
    assert text.splitlines() == [
        "time ->  0    250  500",
        "main     [alpha ][b ]",
        "comm        [ c  ]    ^",
    ]


def test_pictures_timeline_rounds_and_cuts() -> None:
    # 149 ns is 2.98 columns of 50: rounded to 3; a label too long for its span is cut
    text = render_timeline([ev("x", 0, 149, label="longlabel"), ev("y", 149, 170)], 50,
                           lane=lambda e: "l")
    assert text.splitlines()[1] == "l        [l]"


def test_pictures_timeline_refusals() -> None:
    with pytest.raises(PictureError, match="overlaps"):
        render_timeline([ev("a", 0, 100), ev("b", 50, 150)], 10)
    with pytest.raises(PictureError, match="not in lanes"):
        render_timeline([ev("a", 0, 100)], 10, lanes=["other"])
    with pytest.raises(PictureError, match="unit_ns"):
        render_timeline([ev("a", 0, 100)], 0)
    assert render_timeline([], 10) == "time ->"
