"""A served app under a burst of hostile visitors keeps answering a normal one, and leaves no ranks.

    pytest -q -m browser tests/test_viz_hardening_served.py

One ``dplab app`` on a free loopback port, one headless Chromium: a bounded burst of sessions opens
the URLs issue 18 found (thousands of repeated algorithms, a gibibyte vector, repeated 8-rank bench
worlds, 8-rank runs, a training grid of repeats), the visitors leave after a moment, and a normal
visitor must then get a rendered page in a bounded time; the server's ranks, all children of its
process (``dplab app``'s child), must be gone soon after the hostile visitors left. Nothing here
reaches past 127.0.0.1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import (
    CHROMIUM_ARGS,
    AppServer,
    browser_missing,
    chromium_path,
    require_browser,
    wait_rendered,
)

from dplab.viz.budget import cores

pytestmark = pytest.mark.browser

BURST = [
    "/cost?algorithms=" + ",".join(["ring"] * 5000),
    "/collectives?coll_n=1073741824&coll_p=16",
    "/collectives?coll_n=10000000&coll_p=16&coll_algorithm=pipelined_ring",
    "/cost?source=run&bench_world_sizes="
    + ",".join(["8"] * 200)
    + "&bench_sizes=4096,65536,1048576",
    "/runs?world_size=8&steps=50&hidden=512",
    "/runs?world_size=8&steps=50&hidden=256",
    "/runs?world_size=8&steps=49&hidden=512",
    "/training?world_size=6&steps=50&staleness=" + ",".join(["0", "1", "2", "4", "inf"] * 20),
]
START_S = 60.0  # the burst's first ranks start within this (pages load, then their scripts run)
LINGER_S = 2.0  # the hostile visitors stay this long once their ranks run
NORMAL_S = 60.0  # a normal visitor's page renders within this, burst or not
RANKS_GONE_S = 20.0  # the hostile visitors' ranks are gone this long after they left


def descendants(pid: int) -> set[int]:
    """Every process under ``pid`` (its ranks, and anything they started), from /proc."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += list(kids - found)
            found |= kids
    return found


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppServer]:
    reason = browser_missing() or (None if Path("/proc/self/task").exists() else "counts ranks "
                                                                                 "through /proc")
    if reason:
        (pytest.fail if require_browser() else pytest.skip)(reason)
    server = AppServer(tmp_path_factory.mktemp("served") / "dplab-app.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(app: AppServer) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=list(CHROMIUM_ARGS), timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


def test_a_burst_of_hostile_visitors_leaves_the_app_answering_and_no_ranks(app: AppServer,
                                                                          browser: Any) -> None:
    hostile = []
    for path in BURST:
        context = browser.new_context()
        page = context.new_page()
        page.goto(app.url + path, wait_until="commit", timeout=30_000)
        hostile.append(context)
    most, deadline = 0, time.perf_counter() + START_S
    while time.perf_counter() < deadline:  # until their work has started, and a moment more
        most = max(most, len(descendants(app.server_pid)))
        if most:
            deadline = min(deadline, time.perf_counter() + LINGER_S)
        time.sleep(0.1)
    assert most, f"the burst started no ranks in {START_S:.0f} s: this test would prove nothing"
    assert most <= max(8, cores()), (
        f"{most} processes under the server: more than its budget of ranks"
    )
    for context in hostile:
        context.close()  # the visitors leave: their websockets close
    left = time.perf_counter()

    context = browser.new_context()
    try:
        page = context.new_page()
        t0 = time.perf_counter()
        page.goto(app.url + "/collectives?coll_p=6&coll_algorithm=tree", timeout=NORMAL_S * 1000)
        took = time.perf_counter() - t0 + wait_rendered(page, NORMAL_S)
        assert page.get_by_text("Collectives", exact=True).first.is_visible()
        assert not page.locator('[data-testid="stException"]').all_inner_texts()
    finally:
        context.close()

    while descendants(app.server_pid) and time.perf_counter() - left < RANKS_GONE_S:
        time.sleep(0.2)
    gone = time.perf_counter() - left
    still = descendants(app.server_pid)
    print(f"\nburst: at most {most} processes under the server while it lasted; a normal page "
          f"rendered in {took:.1f} s after the visitors left; their ranks gone {gone:.1f} s after")
    assert not still, (
        f"ranks still running {RANKS_GONE_S:.0f} s after their visitors left: {sorted(still)}"
    )
    assert app.proc.poll() is None, app.output()
