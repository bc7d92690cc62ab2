"""The app is a server: what a URL or an upload can make it do is bounded (issue 18, section 2).

Each page is driven by AppTest with the hostile input; real ranks are kept out where the test is
about what a page asks for (a budget with no room answers at once), and used where it is about
killing them (``test_the_watchdog_kills_real_ranks_*``).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

st = pytest.importorskip("streamlit", reason="the viz extra (streamlit) is not installed")
pytest.importorskip("plotly", reason="the viz extra (plotly) is not installed")

from streamlit.testing.v1 import AppTest  # noqa: E402

from dplab.backends.runs import uploads  # noqa: E402
from dplab.reference.errors import ConfigError  # noqa: E402
from dplab.viz import budget  # noqa: E402
from dplab.viz.budget import Budget, Busy, Limits, Stopped  # noqa: E402
from dplab.viz.collectives import COLLECTIVES, CollectiveConfig, algorithms_for, walkthrough  # noqa: E402
from dplab.viz.collectives_figure import figure_spec  # noqa: E402
from dplab.viz.deep_links import MAX_PARAM_CHARS, url_list  # noqa: E402
from dplab.viz.training_runs import TrainingGrid  # noqa: E402

PAGES = Path(__file__).resolve().parents[1] / "viz" / "pages"


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(PAGES / f"{name}.py"), default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def one_line_errors(at: AppTest) -> list[str]:
    """The page's errors; none may be a traceback (a server's file paths) or span lines."""
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert all("\n" not in e and 'File "' not in e and "Traceback" not in e for e in errors), errors
    return errors


@pytest.fixture
def full_budget(monkeypatch: pytest.MonkeyPatch) -> Budget:
    """The server's budget, with every rank held by someone else and a short wait: a page that asks
    for ranks is told the server is busy at once, and starts none."""
    b = Budget(Limits(ranks=2, wait_s=0.3))
    b.acquire(2)
    monkeypatch.setattr(budget, "BUDGET", b)
    return b


# -- lists from a URL ------------------------------------------------------------------------------

def test_url_list_keeps_each_offered_value_once_up_to_a_limit() -> None:
    assert url_list("ring,ring,tree,nosuch,ring", str, ("ring", "tree", "naive"), 5) == [
        "ring",
        "tree",
    ]
    assert url_list("8,8,2,8,4", int, range(2, 9), 2) == [8, 2]
    assert url_list("8,x", int, range(2, 9), 2) is None  # a value that does not parse: the default
    # longer than any real list
    assert url_list(",".join(["ring"] * 5000), str, ("ring",), 5) is None
    assert url_list(None, str, ("ring",), 5) is None
    assert len(",".join(["recursive_doubling"] * 10)) < MAX_PARAM_CHARS  # every real list fits


def test_cost_page_with_thousands_of_repeated_algorithms_draws_at_once() -> None:
    t0 = time.perf_counter()
    at = page("cost", algorithms=",".join(["ring"] * 5000))
    assert not one_line_errors(at) and time.perf_counter() - t0 < 10
    # the URL was not a list: the default
    assert len(at.multiselect(key="cost_algorithms").value) == 6
    at = page("cost", algorithms="ring,tree,ring,tree,ring")
    assert list(at.multiselect(key="cost_algorithms").value) == ["ring", "tree"]
    assert at.query_params["algorithms"] == "ring,tree"


def test_cost_short_bench_runs_each_world_size_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dplab.viz import cost_fit

    asked: list[tuple] = []
    monkeypatch.setattr(
        cost_fit, "run_bench", lambda ps, sizes, **kw: asked.append((ps, sizes)) or []
    )
    at = page("cost", source="run", bench_world_sizes=",".join(["8"] * 40) + ",2,4,6",
              bench_sizes="4096,4096,65536,4096,65536,16384,1048576,262144")
    one_line_errors(at)
    # each once, three at most
    assert list(at.multiselect(key="cost_bench_world_sizes").value) == [8, 2, 4]
    assert list(at.multiselect(key="cost_bench_sizes").value) == [4096, 65536, 16384, 1048576]
    assert asked == [([2, 4, 8], [4096, 16384, 65536, 1048576])]


def test_cost_short_bench_waits_in_the_servers_budget(full_budget: Budget) -> None:
    at = page("cost", source="run", bench_world_sizes="8")
    assert one_line_errors(at) == [
        "the server is busy: waited 0.3 s for 2 ranks behind other visitors' runs; try again in a "
        "minute"]
    assert full_budget.state() == (2, 0)  # nothing started, nothing left waiting


def test_training_page_from_repeats_asks_for_each_run_once(full_budget: Budget) -> None:
    at = page("training", world_size="3", steps="3", staleness=",".join(["0"] * 60 + ["inf"] * 60),
              backup="1,1,1,1,1")
    errors = one_line_errors(at)
    assert list(at.multiselect(key="training_staleness").value) == ["0", "inf"]
    assert list(at.multiselect(key="training_backup").value) == [1]
    assert (
        len(TrainingGrid(world_size=3, steps=3, staleness=(0, None), backup_workers=(1,)).specs())
        == 8
    )
    assert errors and errors[0].startswith("the server is busy")


def test_runs_page_of_eight_ranks_waits_in_the_servers_budget(full_budget: Budget) -> None:
    at = page("runs", world_size="8", steps="2")
    assert one_line_errors(at) == [
        "the server is busy: waited 0.3 s for 2 ranks behind other visitors' runs; try again in a "
        "minute"]


def test_runs_page_refuses_out_of_range_numbers_from_the_url(full_budget: Budget) -> None:
    at = page("runs", world_size="1000000", steps="99999999999999999999", backup="-5")
    one_line_errors(at)
    assert at.number_input(key="runs_world_size").value == 4


# -- the budget ------------------------------------------------------------------------------------

class FakeWorld:
    """A World that starts nothing: counts how many ranks are "running" at once."""

    lock, running, most, order = threading.Lock(), 0, 0, []

    def __init__(self, world_size: int, backend: str = "local", tolerate: frozenset = frozenset(),
                 cluster: str | None = None) -> None:
        self.world_size, self.aborted = world_size, threading.Event()
        with FakeWorld.lock:
            FakeWorld.running += world_size
            FakeWorld.most = max(FakeWorld.most, FakeWorld.running)

    def run(self, seconds: float) -> None:
        if self.aborted.wait(seconds):
            raise RuntimeError("killed")

    def _end(self) -> None:
        with FakeWorld.lock:
            if self.world_size:
                FakeWorld.running -= self.world_size
                self.world_size = 0

    def close(self) -> None:
        self._end()

    def abort(self) -> None:
        self.aborted.set()
        self._end()


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> type[FakeWorld]:
    monkeypatch.setattr(budget, "World", FakeWorld)
    FakeWorld.running, FakeWorld.most, FakeWorld.order = 0, 0, []
    return FakeWorld


def test_six_visitors_of_eight_ranks_run_one_after_another(fake_world: type[FakeWorld]) -> None:
    b = Budget(Limits(ranks=2, wait_s=30))
    done: list[int] = []

    def visitor(i: int) -> None:
        with b.world(8) as world:
            world.run(0.05)
        done.append(i)

    threads = [threading.Thread(target=visitor, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # arrival order
    for t in threads:
        t.join(10)
    assert sorted(done) == list(range(6)) and fake_world.most == 8  # one 8-rank world at a time
    assert b.state() == (0, 0)


def test_a_full_queue_and_a_long_wait_are_refused_in_one_line(fake_world: type[FakeWorld]) -> None:
    b = Budget(Limits(ranks=2, wait_s=0.2, queue=1))
    held = b.acquire(2)
    waiter = threading.Thread(target=lambda: pytest.raises(Busy, b.acquire, 1))
    waiter.start()
    time.sleep(0.05)
    with pytest.raises(Busy, match="1 runs wait already"):
        b.acquire(1)
    waiter.join(5)
    b.release(held)
    assert b.state() == (0, 0) and b.waiting_line(2) is None


def test_a_run_is_killed_when_its_visitor_leaves_or_its_time_is_up(
    fake_world: type[FakeWorld],
) -> None:
    gone = threading.Event()
    b = Budget(Limits(ranks=4, run_s=30))
    threading.Timer(0.2, gone.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Stopped, match="left or changed"), b.world(2, stop=gone.is_set) as world:
        world.run(30)
    assert time.perf_counter() - t0 < 5 and b.state() == (0, 0)
    b = Budget(Limits(ranks=4, run_s=0.2))
    with pytest.raises(Stopped, match="after 0.2 s, this app's limit"), b.world(2) as world:
        world.run(30)
    gone.clear()
    stopped_waiting = Budget(Limits(ranks=1))
    stopped_waiting.acquire(1)
    threading.Timer(0.2, gone.set).start()
    with pytest.raises(Stopped, match="before it started"):
        stopped_waiting.acquire(1, stop=gone.is_set)


def _sleep(comm: object, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for task in Path(f"/proc/{me}/task").iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        out |= {int(p) for p in text.split()}
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts children through /proc")
def test_the_watchdog_kills_real_ranks_past_their_time() -> None:
    before = _children()
    b = Budget(Limits(ranks=2, run_s=1.0))
    t0 = time.perf_counter()
    with pytest.raises(Stopped, match="after 1 s"), b.world(2) as world:
        world.run(_sleep, 60.0)
    assert time.perf_counter() - t0 < 15
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children() - before and b.state() == (0, 0)


# -- caches and sizes ------------------------------------------------------------------------------

def test_a_billion_element_collective_holds_no_vectors() -> None:
    w = walkthrough(CollectiveConfig("allreduce", "ring", 16, 1 << 30))
    assert w.inputs is None and w.final_values is None and w.frames[-1].values is None


def test_the_largest_cached_collective_is_bounded() -> None:
    """The page's cache holds 16 entries (``max_entries``): each one is what bounds it in bytes."""
    src = (PAGES / "collectives.py").read_text()
    assert "@st.cache_data(show_spinner=False, max_entries=16)" in src
    biggest = max(
        len(pickle.dumps((w := walkthrough(CollectiveConfig(c, a, 16, n)), figure_spec(w))))
        for c in COLLECTIVES
        for a in algorithms_for(c)
        if a in ("pipelined_ring", "ring")
        for n in (256, 1 << 30)
    )
    assert biggest < 16 << 20  # 16 entries of at most 16 MB


def test_collectives_page_of_a_gibibyte_vector_draws_without_a_traceback() -> None:
    t0 = time.perf_counter()
    at = page("collectives", coll_n=str(1 << 30), coll_p="16")
    assert not one_line_errors(at) and time.perf_counter() - t0 < 20
    assert at.number_input(key="coll_n").value == 1 << 30
    at = page("collectives", coll_n="99999999999999999999", coll_p="1000")
    assert not one_line_errors(at)


# -- uploads ---------------------------------------------------------------------------------------

def bench_file(**row: object) -> bytes:
    base = {
        "backend": "local",
        "algorithm": "ring",
        "world_size": 2,
        "bytes": 4096,
        "time_us": 10.0,
    }
    return json.dumps({"meta": {"command": "bench"}, "rows": [base | row]}).encode()


HOSTILE_BENCH = {
    "a billion ranks": (
        bench_file(world_size=1_000_000_000),
        "row 0's world_size 1e+09 is outside 1..128",
    ),
    "a 400-digit size": (
        bench_file(bytes=0).replace(b'"bytes": 0', b'"bytes": 1' + b"0" * 400),
        "not JSON (an integer of 401 digits)",
    ),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    "a list for a name": (bench_file(algorithm=["ring"]), "row 0's algorithm is list, not str"),
    "infinity": (
        bench_file(time_us=0).replace(b'"time_us": 0', b'"time_us": Infinity'),
        "not JSON",
    ),
    "too large": (b" " * (2 << 20), "more than the 1,048,576 this accepts"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BENCH))
def test_hostile_bench_files_are_refused_in_one_line(case: str) -> None:
    data, words = HOSTILE_BENCH[case]
    with pytest.raises(ConfigError) as e:
        uploads.bench_rows(data, "b.json")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cost_page_refuses_a_billion_rank_bench_file_in_one_line() -> None:
    at = page("cost", source="file")
    t0 = time.perf_counter()
    at.file_uploader(key="cost_files").set_value(("b.json", bench_file(world_size=1_000_000_000),
                                                  "application/json")).run()
    assert one_line_errors(at) == [
        "b.json: row 0's world_size 1e+09 is outside 1..128, what this fits: give a file written "
        "by `dplab bench --json`"]
    assert time.perf_counter() - t0 < 10


def test_tune_from_json_uses_the_same_check(tmp_path: Path, cli_here) -> None:  # noqa: ANN001
    path = tmp_path / "b.json"
    path.write_bytes(bench_file(world_size=1_000_000_000))
    done = cli_here("tune", "--from-json", str(path), "--out", str(tmp_path / "t.json"))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"dplab tune: error: {path}: row 0's world_size 1e+09 is "
                                   "outside 1..128, what this fits: give a file written by `dplab "
                                   "bench --json`")
    assert not (tmp_path / "t.json").exists()


EVENT = {"rank": 0, "kind": "forward", "t_start_ns": 0, "t_end_ns": 10}
HOSTILE_TRACES = {
    "nested": b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a list for a kind": json.dumps({"events": [EVENT | {"kind": ["forward"]}]}).encode(),
    "a string for a rank": json.dumps({"events": [EVENT | {"rank": "0"}]}).encode(),
    "a 400-digit time": json.dumps({"events": [EVENT | {"t_end_ns": 7}]}).encode().replace(
        b'"t_end_ns": 7', b'"t_end_ns": 1' + b"0" * 400),
    "an unknown field": json.dumps({"events": [EVENT | {"x": 1}]}).encode(),
    "an extra of objects": json.dumps({"events": [EVENT | {"extra": {"step": {"a": 1}}}]}).encode(),
    "events that are not a list": b'{"events": {"rank": 0}}',
    "a rank of a billion": json.dumps({"events": [EVENT | {"rank": 10**9}]}).encode(),
}


def test_runs_page_refuses_hostile_traces_in_one_line() -> None:
    at = page("runs", source="file")
    for case, data in HOSTILE_TRACES.items():
        at.get("file_uploader")[0].set_value((f"{case}.json", data, "application/json")).run()
        errors = one_line_errors(at)
        assert len(errors) == 1 and errors[0].startswith("not a dplab trace file ("), (case, errors)
    ok = json.dumps(
        {"events": [EVENT], "meta": {"row": {"straggler": ["x"], "world_size": 1}}}
    ).encode()
    at.get("file_uploader")[0].set_value(("ok.json", ok, "application/json")).run()
    assert not one_line_errors(at)


def test_the_regions_map_offers_no_world_size_that_takes_minutes() -> None:
    at = page("cost")
    at.toggle(key="regions_on").set_value(True).run()
    assert not one_line_errors(at)
    # ~10 s; 4096: minutes
    assert [int(o) for o in at.select_slider(key="regions_max_p").options][-1] == 1024
