"""The default tier's share of an engine x world-size matrix (issue 28), for the tests that take the
conftest's ``backend`` fixture:

    @pytest.mark.parametrize("backend, p", engines([1, 2, 3, 4]), indirect=["backend"])
    def test_x(worlds, backend, p): ...

The reference transport (``local``) keeps its whole sweep of world sizes in the default ``pytest``;
every other engine (mpi, torch, sim, cuda) keeps every test at ``KEEP`` (an odd p, and p = 4), and
its other world sizes run under ``pytest -m slow`` (CI runs both). So every engine still runs every
test by default, and the exhaustive matrix still runs in CI: each of its other worlds costs a whole
world start (an MPI world with torch: 5-16 CPU seconds) and up to 8 ranks on the two cores.

Property tests draw p inside the test: ``engine_spans(1, 8)`` gives ``(backend, (lo, hi))``, and
the test draws ``p`` from ``st.integers(lo, hi)`` (``data.draw``).
"""

from __future__ import annotations

import pytest

from dplab.backends.launch.world import BACKENDS

__all__ = ["KEEP", "engines", "engine_spans"]

KEEP = (3, 4)  # an odd world (uneven chunks, a ring that is not a power of two) and p = 4


def _marks(name: str, slow: bool) -> list:
    marks = [] if name == "local" else [getattr(pytest.mark, name)]  # as the backend fixture's
    return marks + [pytest.mark.slow] if slow else marks


def engines(ps: list[int], keep: tuple[int, ...] = KEEP) -> list:
    """``(backend, p)`` params: ``local`` at every p of ``ps``; each other engine at the p of
    ``keep`` by default and at the rest of ``ps`` in the slow tier (the exhaustive sweep)."""
    kept = [p for p in ps if p in keep]
    assert kept, f"none of {keep} in {ps}: every engine must keep a world size by default"
    return [pytest.param(name, p, marks=_marks(name, name != "local" and p not in kept),
                         id=f"{name}-{p}")
            for name in BACKENDS for p in ps]


def engine_spans(lo: int, hi: int, keep: tuple[int, ...] = KEEP) -> list:
    """``(backend, (lo, hi))`` params for a property test that draws p: ``local`` draws from
    ``lo..hi`` by default; each other engine draws from ``keep``'s span by default, and from
    ``lo..hi`` in the slow tier."""
    out = []
    for name in BACKENDS:
        if name == "local":
            out.append(pytest.param(name, (lo, hi), id=name))
            continue
        out.append(pytest.param(name, (min(keep), max(keep)), marks=_marks(name, False), id=name))
        out.append(pytest.param(name, (lo, hi), marks=_marks(name, True), id=f"{name}-all-p"))
    return out
