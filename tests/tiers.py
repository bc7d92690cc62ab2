"""Which cases of an exhaustive list the default ``pytest`` runs: a few that stand for the rest
(one of each way the checker can judge), the others marked ``slow``, which CI's second tier runs
(``pytest -m "slow or browser or hosts"``), so every case still runs on every CI build.

    @pytest.mark.parametrize("name", sampled(sorted(WRONG), keep={"no-divide", "wait-in-hook"}))

For lists whose every case costs a fresh checker process (a learner's plausible wrong answer,
judged in a child interpreter with its own ranks: 1-3 CPU-seconds each), where running them all
made the lessons a quarter of the default run's CPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pytest

__all__ = ["sampled"]


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
