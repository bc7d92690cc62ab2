"""What the default ``pytest`` runs of an exhaustive list, and what it leaves to ``pytest -m slow``
(issue 28; CI's second tier, ``pytest -m "slow or browser or hosts"``, runs the rest, so every case
still runs on every CI build).

An engine x world-size matrix, for the tests that take the conftest's ``backend`` fixture:

    @pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
    def test_x(worlds, backend, p): ...

The reference transport (``local``) keeps its whole sweep of world sizes in the default ``pytest``;
every other engine (mpi, torch, sim, cuda) keeps every test at ``KEEP`` (p = 3: an odd world), and
its other world sizes run under ``pytest -m slow``. So every engine still runs every test by
default: each of its other worlds costs a whole world start (an MPI world with torch: 5-16 CPU
seconds) and up to 8 ranks on the two cores, and what another engine adds is its transport, which
the schedules' sizes do not change (local proves the schedules at every p).

Property tests draw p inside the test: ``engine_spans(1, 8)`` gives ``(backend, Sweep)``; the test
draws ``p`` from ``st.integers(sweep.lo, sweep.hi)`` and runs ``sweep.examples(n)`` examples. By
default another engine draws p from ``KEEP`` and runs a quarter of the examples (at least 3): its
transport is what it adds, and a quarter still crosses it hundreds of times; the slow tier runs it
with every example at every p, as local runs by default.

A list of a learner's plausible wrong answers, each judged in a fresh checker process with its own
ranks (1-3 CPU-seconds each): ``sampled`` keeps a few that stand for the rest (one of each way the
checker can judge) and marks the others slow:

    @pytest.mark.parametrize("name", sampled(sorted(WRONG), keep={"no-divide", "wait-in-hook"}))
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import pytest

from dplab.backends.launch.world import BACKENDS

__all__ = ["KEEP", "Sweep", "engines", "engine_spans", "sampled"]

KEEP = (3,)  # an odd world: uneven chunks, a ring and a tree that are not a power of two


def _marks(name: str, slow: bool) -> list:
    marks = [] if name == "local" else [getattr(pytest.mark, name)]  # as the backend fixture's
    return marks + [pytest.mark.slow] if slow else marks


def engines(ps: list, keep: tuple[int, ...] = KEEP) -> list:
    """``(backend, p)`` params: ``local`` at every p of ``ps``; each other engine at the p of
    ``keep`` by default and at the rest of ``ps`` in the slow tier (the exhaustive sweep). An entry
    of ``ps`` may be a tuple whose first item is p: the param is then ``(backend, *entry)``."""
    cases = [c if isinstance(c, tuple) else (c,) for c in ps]
    kept = [c for c in cases if c[0] in keep]
    assert kept, f"none of {keep} in {ps}: every engine must keep a world size by default"
    return [pytest.param(name, *c, marks=_marks(name, name != "local" and c not in kept),
                         id="-".join(map(str, (name, *c))))
            for name in BACKENDS for c in cases]


class Sweep(NamedTuple):
    """The world sizes ``lo..hi`` a property test draws from, and its share of the examples."""

    lo: int
    hi: int
    share: float = 1.0

    def examples(self, n: int) -> int:
        """This sweep's number of examples, of ``n`` for a full one (at least 3)."""
        return max(3, round(n * self.share))


def engine_spans(lo: int, hi: int, keep: tuple[int, ...] = KEEP) -> list:
    """``(backend, Sweep)`` params for a property test that draws p: ``local`` draws from
    ``lo..hi`` with every example by default; each other engine draws from ``keep``'s span with a
    quarter of them by default, and from ``lo..hi`` with every example in the slow tier."""
    out = []
    for name in BACKENDS:
        if name == "local":
            out.append(pytest.param(name, Sweep(lo, hi), id=name))
            continue
        out.append(pytest.param(name, Sweep(min(keep), max(keep), 0.25), marks=_marks(name, False),
                                id=name))
        out.append(pytest.param(name, Sweep(lo, hi), marks=_marks(name, True), id=f"{name}-all-p"))
    return out



def sampled(cases: Sequence[Any], keep: Collection[str],
            ids: Sequence[str] | None = None) -> list[Any]:
    """``cases`` as ``pytest.param``s: those whose id is in ``keep`` unmarked, the rest ``slow``.

    Args:
        cases: the parametrize values, one per case (a tuple where the test takes several).
        keep: the ids of the cases the default run keeps.
        ids: each case's id; None: ``str(case)`` (a list of names).

    Returns:
        The cases, in order, with their ids, ready for ``pytest.mark.parametrize``.

    Raises:
        ValueError: a kept id names no case (a rename would silently move it to the slow tier).
    """
    ids = [str(c) for c in cases] if ids is None else list(ids)
    unknown = sorted(set(keep) - set(ids))
    if unknown:
        raise ValueError(f"sampled(): kept ids {unknown} name no case; the cases are {ids}")
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), id=i,
                         marks=() if i in keep else pytest.mark.slow)
            for c, i in zip(cases, ids)]
