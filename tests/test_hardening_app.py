"""The app server beside many visitors: its own stderr, its imports, its budget, its memory, and
``dplab app`` itself.

Lesson sessions capture their output per thread without touching the process's file descriptors
(three sessions at once used to leave the server's fd 2 on a deleted temp file, and their steps
failed with "I/O operation on closed file"); lesson worlds wait in the server's rank budget like
every other run, through a lease that never waits while it holds ranks; ended sessions give their
uploaded files back; ``dplab app`` prints its URL once the server answers and exits 130 on Ctrl-C.
The browser test opens 8 lesson sessions at once against a real server.

    pytest -q tests/test_hardening_app.py                 # the browser tests: -m browser
"""

from __future__ import annotations

import io
import os
import sys
import threading
from pathlib import Path

import pytest

from dplab.lessons import lesson
from dplab.lessons.runner import Lab, run_step
from dplab.viz.budget import Budget, Limits

DPLAB = [sys.executable, "-m", "dplab.backends.cli"]
SESSIONS = 8


def _fd(pid: int | str, fd: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# --- capture: per thread, never the process's fds ----------------------------------------------

def test_captures_in_two_threads_keep_apart_and_leave_the_process_alone(capfd):
    from dplab.lessons.capture import capturing

    fd2 = _fd("self", 2)
    inside = threading.Barrier(2)
    seen = {}

    def session(name: str) -> None:
        buf_out, buf_err = io.StringIO(), io.StringIO()
        with capturing(stdout=buf_out, stderr=buf_err):
            inside.wait()  # both capture at once
            print(f"out of {name}")
            print(f"err of {name}", file=sys.stderr)
            inside.wait()
        seen[name] = (buf_out.getvalue(), buf_err.getvalue())

    threads = [threading.Thread(target=session, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("the test's own")
    assert seen == {"a": ("out of a\n", "err of a\n"), "b": ("out of b\n", "err of b\n")}
    assert _fd("self", 2) == fd2
    assert "the test's own" in capfd.readouterr().out  # outside a capture: where it always went


def _steps(number: int, upto: int, errors: list, fd2: str) -> None:
    les = lesson(number)
    try:
        with Lab() as lab:
            for i in range(upto):
                out = run_step(les.steps[i], lab)
                assert out.ok, [c.claim for c in out.checks if not c.holds]
                assert _fd("self", 2) == fd2, "a session moved the process's stderr"
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(f"{type(e).__name__}: {e}")


def test_eight_lesson_sessions_at_once_in_one_process_keep_its_fds():
    """What the app's server does: a thread per session, each its own Lab, steps at once."""
    fds = {fd: _fd("self", fd) for fd in (0, 1, 2)}
    errors: list[str] = []
    threads = [threading.Thread(target=_steps, args=(1, 3, errors, fds[2]))
               for _ in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a session did not finish in 300 s"
    assert errors == []
    assert {fd: _fd("self", fd) for fd in (0, 1, 2)} == fds


# --- the budget: lesson worlds wait their turn, and a lease never deadlocks ----------------------

def test_a_lease_holds_its_worlds_ranks_and_never_waits_while_holding():
    budget = Budget(Limits(ranks=2, wait_s=60))
    lease = budget.lease()
    with Lab(open_world=lease.world) as lab:
        lab.world(1)
        assert budget.state() == (1, 0)
        lab.world(2)  # one more: 3 ranks, more than the budget, so all of it (no self-deadlock)
        assert budget.state() == (2, 0)
        assert lab.world(2).run(_rank_of) == [0, 1]
    assert budget.state() == (0, 0)  # closed: every rank given back


def _rank_of(comm) -> int:
    return comm.rank


def test_two_leases_that_each_hold_ranks_both_finish():
    budget = Budget(Limits(ranks=2, wait_s=60))
    both = threading.Barrier(2, timeout=60)
    done, errors = [], []

    def visitor(name: str) -> None:
        try:
            with Lab(open_world=budget.lease().world) as lab:
                lab.world(1)
                both.wait()  # each holds one rank, then asks for more
                lab.world(2)
                done.append(name)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))
            both.abort()

    threads = [threading.Thread(target=visitor, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and sorted(done) == ["a", "b"]
    assert budget.state() == (0, 0)


def test_the_lessons_page_runs_its_worlds_through_the_servers_budget(monkeypatch):
    st = pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from dplab.backends.cli.app import app_path
    from dplab.viz import budget as budget_module

    budget = Budget(Limits(ranks=2))
    asked = []
    real = budget.acquire
    monkeypatch.setattr(budget, "acquire",
                        lambda n, stop=budget_module._never: asked.append(n) or real(n, stop))
    monkeypatch.setattr(budget_module, "BUDGET", budget)
    st.cache_data.clear()
    at = AppTest.from_file(str(app_path()), default_timeout=120)
    at.query_params["lesson"], at.query_params["step"] = "1", "3"  # asks nothing first: it runs
    at.run()
    at.switch_page("pages/lessons.py").run()
    assert not at.exception, at.exception
    assert not [e.value for e in at.error], [e.value for e in at.error]
    assert asked and all(n == 2 for n in asked), asked  # min(4 ranks, the budget's 2), each step
    assert budget.state() == (0, 0)
    st.cache_data.clear()
