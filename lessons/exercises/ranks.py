"""The learner's ranks in the check's child: a local world of them, and how it ended as a verdict.

    # a collector, in the child (``child.py``), for each world size p:
    done = run_ranks(_rank, p, (str(file), cfg, deadline), file, "zero2_step", TIMEOUT_S)
    # each rank, before any line of the learner's:
    stop_before(deadline)

``run_ranks`` returns every rank's dict, or raises what the child reports: a ``Fail`` that begins
``at p=...`` (a rank raised, named at the learner's line; the check's time limit came while the
child waited for the ranks; a rank's counters were tampered with), ``Patched`` (dplab's functions
were replaced), or ``CheckUnavailable`` (the machine, not the answer, stopped a rank).
``stop_before`` makes a rank stop itself a little before the child's own limit, so that its
traceback names the learner's line rather than the line the child was waiting on.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dplab.backends import RankError, launch
from dplab.lessons.exercises.child import Patched
from dplab.lessons.exercises.learner import CheckUnavailable, Fail, TooLong, limit_s, rank_failure

__all__ = ["run_ranks", "stop_before"]


def run_ranks(rank: Callable[..., dict[str, Any]], p: int, args: tuple[Any, ...], file: Path,
              what: str, timeout: float) -> list[dict[str, Any]]:
    """Run ``rank(comm, *args)`` on a local world of ``p`` ranks; every rank's dict, in rank order.

    Args:
        rank: a rank's work; its dict holds ``"patched"`` (``child.patched_since``) and may hold
            ``"tampered"`` (``Traffic.tampered``: why its counts cannot be trusted, or "").
        p: the world size.
        args: ``rank``'s arguments after ``comm``.
        file: the learner's file, whose lines a failure names.
        what: what the learner's code is called in a failure ("zero2_step raised on rank 1").
        timeout: how long a collective waits for a rank that never calls it.

    Returns:
        Every rank's dict.

    Raises:
        Fail: at p: a rank raised, the check's time limit came, or a rank's counts were tampered.
        Patched: a rank found dplab's functions replaced.
        CheckUnavailable: the machine stopped a rank (a full /dev/shm).
    """
    try:
        done = launch(rank, p, args=args, timeout=timeout)
    except TooLong as e:  # here, waiting for ranks that swallowed their own stop
        raise Fail(f"at p={p}: {what} {e}") from None
    except RankError as e:
        failure = rank_failure(e, file, what)
        if isinstance(failure, CheckUnavailable):
            raise failure from None
        raise Fail(f"at p={p}: {failure}") from None
    patched = sorted({name for r in done for name in r["patched"]})
    if patched:
        raise Patched(patched)
    tampered = next((r["tampered"] for r in done if r.get("tampered")), "")
    if tampered:
        raise Fail(f"at p={p}: {tampered}")
    return done


def stop_before(deadline: float, why: str = "does a loop never end?") -> None:
    """In a rank: raise ``TooLong`` in it a little before ``deadline`` (``time.monotonic``, one
    clock for the child and its ranks), asking ``why``; ``signal.setitimer(signal.ITIMER_REAL, 0)``
    disarms it."""
    def stop(signum: int, frame: Any) -> None:
        raise TooLong(f"still running at the check's time limit of {limit_s():g} s: {why}")

    left = deadline - time.monotonic()
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(left - min(1.0, 0.2 * left), 0.01))
