"""The app in a real browser: Debian's Chromium, driven by playwright, against ``dplab app``.

    pytest -q -m browser tests/test_viz_browser.py
    DPLAB_ARTIFACTS=/tmp/shots pytest -q -m browser tests/test_viz_browser.py  # keep screenshots

AppTest runs the pages' scripts but draws nothing: a figure whose JSON plotly.js rejects, a
Play button that does not animate, a page that never finishes rendering all pass there. Here
one ``dplab app`` serves the module (a free loopback port, stopped at the end) and a headless
Chromium opens every page file under ``viz/pages/`` twice, each time as a new session: the first
visit (a fresh browser profile) pays for whatever the page computes, the second (the same
browser, a new tab) finds it in ``st.cache_data`` and plotly.js in the browser's cache. Both times
(navigation to rendered, see browser_helpers) go to ``render_times.json`` beside the
screenshots, one ``<page>.png`` per page. Missing Chromium or playwright skips with the reason
(fails under ``DPLAB_REQUIRE_BROWSER=1``, as in CI).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import (
    CHROMIUM_ARGS,
    EXCEPTION_SELECTOR,
    AppServer,
    browser_missing,
    chromium_path,
    require_browser,
    wait_rendered,
)

from dplab.viz.added_pages import added_pages

pytestmark = pytest.mark.browser

PAGES_DIR = Path(__file__).resolve().parent.parent / "viz" / "pages"
# viz/pages/ and the pages from above viz/ (the Lessons page, in lessons/), by their URL names
PAGE_FILES = sorted([*(p.stem for p in PAGES_DIR.glob("*.py") if not p.stem.startswith("_")),
                     *(p.name for p in added_pages())])
COLD_TIMEOUT_S = 120.0  # a first visit may train or bench before it draws
WARM_TIMEOUT_S = 30.0
VIEWPORT = {"width": 1400, "height": 900}
ROUND_CAPTION = re.compile(r"\bround (\d+) of (\d+)", re.IGNORECASE)
TEXT_SELECTOR = '[data-testid="stCaptionContainer"], [data-testid="stMarkdownContainer"]'
# True once the first "round k of n" text on the page differs from the one before the click.
CAPTION_CHANGED_JS = """([selector, before]) => {
  const text = [...document.querySelectorAll(selector)].map(e => e.innerText)
    .find(t => /round \\d+ of \\d+/i.test(t));
  return text !== undefined && text !== before;
}"""
DEFAULT_PAGE = "home"  # viz/app.py: st.Page(... "home.py", default=True)
NOT_FOUND_JS = """() => [...document.querySelectorAll('[role=dialog]')]
  .some(d => /page not found/i.test(d.innerText))"""
TIMES: dict[str, dict[str, float]] = {}


def url_path(stem: str) -> str:
    """The URL st.Page gives a page file: its name less a leading number (``1_runs`` -> ``runs``);
    the default page (Home) lives at the root, and ``/home`` is "Page not found" there."""
    return "" if stem == DEFAULT_PAGE else re.sub(r"^\d+[_ -]*", "", stem)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = Path(os.environ["DPLAB_ARTIFACTS"]) if os.environ.get("DPLAB_ARTIFACTS") else \
        tmp_path_factory.mktemp("browser")
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    if TIMES:
        (folder / "render_times.json").write_text(json.dumps(TIMES, indent=2) + "\n")
        print(f"\nbrowser artifacts in {folder}: " + ", ".join(
            f"{name} {t['first_s']:.2f}/{t['cached_s']:.2f} s" for name, t in TIMES.items()))


@pytest.fixture(scope="module")
def app(artifacts: Path) -> Iterator[AppServer]:
    reason = browser_missing()
    if reason:
        (pytest.fail if require_browser() else pytest.skip)(reason)
    server = AppServer(artifacts / "dplab-app.log").start()
    try:
        yield server
    finally:
        rc = server.stop()
    assert rc in (0, -15, 143), f"dplab app ended with {rc} on SIGTERM:\n{server.output()}"


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


class Visit:
    """One new session on one page: the page, its JavaScript errors, and how long it took to
    render."""

    def __init__(self, browser: Any, url: str, timeout_s: float, context: Any = None) -> None:
        self.owns_context = context is None
        self.context = browser.new_context(viewport=VIEWPORT) if context is None else context
        self.page = self.context.new_page()
        self.js_errors: list[str] = []
        self.page.on("pageerror", lambda e: self.js_errors.append(str(e)))
        t0 = time.perf_counter()
        self.page.goto(url, timeout=timeout_s * 1000)
        self.render_s = time.perf_counter() - t0 + wait_rendered(self.page, timeout_s)

    def exceptions(self) -> list[str]:
        return self.page.locator(EXCEPTION_SELECTOR).all_inner_texts()

    def screenshot(self, path: Path) -> None:
        """The whole page: Streamlit scrolls inside its main block, so a full-page shot of the
        document is one screen; grow the window to the content's height, shoot, and restore."""
        height = self.page.evaluate("""() => Math.max(...['stMain', 'stSidebarContent']
            .map(id => document.querySelector(`[data-testid=${id}]`)).filter(Boolean)
            .map(e => e.scrollHeight))""")
        self.page.set_viewport_size(
            {"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], height)}
        )
        self.page.wait_for_timeout(300)  # plotly resizes its charts to the new width
        self.page.screenshot(path=str(path))
        self.page.set_viewport_size(VIEWPORT)

    def close(self) -> None:
        self.page.close()
        if self.owns_context:
            self.context.close()


@pytest.fixture
def visit(browser: Any, app: AppServer) -> Iterator[Any]:
    opened: list[Visit] = []

    def open_page(stem: str, timeout_s: float = COLD_TIMEOUT_S, context: Any = None) -> Visit:
        opened.append(Visit(browser, f"{app.url}/{url_path(stem)}", timeout_s, context))
        return opened[-1]

    yield open_page
    for v in reversed(opened):
        v.close()


def test_viz_browser_missing_chromium_skips_with_the_reason_and_fails_in_ci(tmp_path: Path) -> None:
    """No browser: a visible skip that says how to install one;
    under DPLAB_REQUIRE_BROWSER=1 a failure."""
    argv = [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", "-n", "0",
            __file__,  # one process: its summary is read below (pytest leaves out -m browser)
            "-m", "browser", "-k", "every_page_file_is_in_the_navigation"]
    env = {
        **os.environ,
        "DPLAB_CHROMIUM": str(tmp_path / "no-chromium"),
        "DPLAB_REQUIRE_BROWSER": "",
        "DPLAB_ARTIFACTS": str(tmp_path),
    }
    skipped = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    assert "SKIPPED" in skipped.stdout, skipped.stdout[-2000:]
    assert "apt-get install -y chromium" in skipped.stdout, skipped.stdout[-2000:]
    failed = subprocess.run(
        argv, env={**env, "DPLAB_REQUIRE_BROWSER": "1"}, capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1 and "apt-get install -y chromium" in failed.stdout, failed.stdout[
        -2000:
    ]


def test_viz_browser_every_page_file_is_in_the_navigation(visit: Any, app: AppServer) -> None:
    """A page file that st.navigation does not list is unreachable: its URL falls back to Home."""
    home = visit("")
    hrefs = home.page.locator('[data-testid="stSidebarNav"] a').evaluate_all(
        "els => els.map(e => new URL(e.href).pathname.replace(/^\\//, ''))")
    assert "" in hrefs, f"no link to the default page in the sidebar: {hrefs}"
    missing = [s for s in PAGE_FILES if url_path(s) not in hrefs]
    assert not missing, f"viz/pages files not in st.navigation: {missing} (sidebar has {hrefs})"
    assert len(hrefs) >= len(PAGE_FILES), (hrefs, PAGE_FILES)


@pytest.mark.parametrize("stem", PAGE_FILES)
def test_viz_browser_page_renders_without_exceptions(
    visit: Any, artifacts: Path, stem: str
) -> None:
    """Every page, as a newcomer opens it: no exception block, no JavaScript error, a title, a
    screenshot."""
    first = visit(stem)
    assert not first.page.evaluate(NOT_FOUND_JS), f"{stem}: 'Page not found' at /{url_path(stem)}"
    landed = first.page.evaluate("location.pathname").strip("/")
    assert landed == url_path(stem), (
        f"{stem}: /{url_path(stem)} landed on /{landed} (a page st.navigation lacks falls back to "
        "Home)"
    )
    assert first.exceptions() == [], f"{stem}: Streamlit exception block(s)"
    assert first.js_errors == [], f"{stem}: JavaScript errors in the page"
    titles = [t.strip() for t in first.page.locator("h1").all_inner_texts() if t.strip()]
    assert titles, f"{stem}: rendered without a title"
    charts = first.page.locator('[data-testid="stPlotlyChart"] .main-svg').count()
    first.screenshot(artifacts / f"{stem}.png")
    # A second session in the same browser: its runs come from st.cache_data, plotly.js from the
    # browser's cache, as when someone opens the page again.
    cached = visit(stem, WARM_TIMEOUT_S, context=first.context)
    assert cached.exceptions() == [] and cached.js_errors == []
    TIMES[stem] = {"first_s": round(first.render_s, 3), "cached_s": round(cached.render_s, 3),
                   "plotly_svgs": charts, "title": titles[0]}


def _round_caption(page: Any) -> str:
    texts = page.locator(TEXT_SELECTOR).all_inner_texts()
    found = [t for t in texts if ROUND_CAPTION.search(t)]
    assert found, f"no 'round k of n' caption on the Collectives page: {texts[:8]}"
    return found[0]


@pytest.mark.skipif("collectives" not in PAGE_FILES, reason="viz/pages/collectives.py is not "
                                                            "written yet")
def test_viz_browser_collectives_next_changes_the_round_caption(
    visit: Any, artifacts: Path
) -> None:
    v = visit("collectives")
    before = _round_caption(v.page)
    v.page.get_by_role("button", name=re.compile(r"^\W*Next\W*$")).first.click()
    v.page.wait_for_function(
        CAPTION_CHANGED_JS, arg=[TEXT_SELECTOR, before], timeout=WARM_TIMEOUT_S * 1000
    )
    wait_rendered(v.page, WARM_TIMEOUT_S)
    after = _round_caption(v.page)
    k0, n0 = map(int, ROUND_CAPTION.search(before).groups())
    k1, n1 = map(int, ROUND_CAPTION.search(after).groups())
    assert (k1, n1) == (k0 + 1, n0), f"Next: {before!r} -> {after!r}"
    assert v.exceptions() == [] and v.js_errors == []
    v.screenshot(artifacts / "collectives-after-next.png")


def _slider_state(page: Any) -> list[dict[str, Any]]:
    """Each plotly chart's first slider: its active step and how many steps (= frames) it has."""
    return page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(el => {
        const s = (el._fullLayout.sliders || [])[0];
        if (!s) return null;
        return {active: s.active, steps: s.steps.length,
                frames: (el._transitionData._frames || []).length};
    })""")


def _colorscales(page: Any, i: int) -> list[Any]:
    """The colour scales plotly.js draws chart ``i``'s traces with (resolved, as on screen)."""
    return page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i]._fullData"
                         ".map(t => t.colorscale || null)", i)


# Per-frame timestamps of a chart's animation, from plotly's own event (performance.now(), ms).
RECORD_FRAMES_JS = """(i) => { const gd = document.querySelectorAll('.js-plotly-plot')[i];
  window.__frames = [];
  gd.on('plotly_animatingframe', () => window.__frames.push(performance.now())); }"""


@pytest.mark.skipif("collectives" not in PAGE_FILES, reason="viz/pages/collectives.py is not "
                                                            "written yet")
def test_viz_browser_collectives_deep_link_p16_ring_animates_smoothly(
    visit: Any, artifacts: Path
) -> None:
    """A link opens the p=16 ring at round 3 of 30; Play then draws frame after frame at its pace.
    Play runs client-side: the slider moves while the server does nothing (no rerun per frame), and
    the colour scale stays the one of the first view. (One visit for both: each costs a page
    run.)"""
    v = visit(
        "collectives?coll_collective=allreduce&coll_algorithm=ring&coll_p=16&coll_n=64&coll_round=2"
    )
    assert ROUND_CAPTION.search(_round_caption(v.page)).groups() == ("3", "30")
    i = next(j for j, s in enumerate(_slider_state(v.page)) if s)
    assert _slider_state(v.page)[i] == {"active": 2, "steps": 31, "frames": 31}
    scales_before = _colorscales(v.page, i)
    v.page.evaluate(RECORD_FRAMES_JS, i)
    chart = v.page.locator(".js-plotly-plot").nth(i)
    chart.scroll_into_view_if_needed()
    chart.locator(".updatemenu-button", has_text="Play").first.click()
    frames = 6
    v.page.wait_for_function(
        f"() => window.__frames.length > {frames}", timeout=WARM_TIMEOUT_S * 1000
    )
    script_state = v.page.locator('[data-testid="stApp"]').get_attribute("data-test-script-state")
    assert script_state == "notRunning", (
        "Play reran the script: the animation must run in the browser"
    )
    assert _slider_state(v.page)[i]["active"] > 2
    # A colour must mean the same count in every frame: plotly.py spells a named scale out in the
    # frames, while plotly.js resolves the same name (its own, reversed "Blues") in the first view.
    assert _colorscales(v.page, i) == scales_before, "the colour scale changed when Play started"
    stamps = v.page.evaluate("window.__frames")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    play_ms = v.page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i]"
                              ".layout.updatemenus[0].buttons[0].args[1].frame.duration", i)
    record = {"play_ms": play_ms, "gaps_ms": [round(g, 1) for g in gaps]}
    (artifacts / "p16_ring_frame_gaps_ms.json").write_text(json.dumps(record) + "\n")
    assert v.exceptions() == [] and v.js_errors == []
    # The pace is plotly's frame duration: no frame comes sooner, and most within a second of it.
    # Not every one: on a busy machine the browser's draw of a single frame can stall for seconds,
    # which says nothing about the page.
    assert min(gaps) > play_ms - 50, f"frames drawn {gaps} ms apart, asked for {play_ms} ms"
    assert statistics.median(gaps) < play_ms + 1000, (
        f"frames drawn {gaps} ms apart, asked for {play_ms} ms"
    )
    v.screenshot(artifacts / "collectives-p16-ring.png")


@pytest.mark.skipif("runs" not in PAGE_FILES, reason="viz/pages/runs.py is not written yet")
def test_viz_browser_runs_chrome_trace_downloads(visit: Any, artifacts: Path) -> None:
    """The download button hands the browser the run's Chrome trace:
    one process per rank, spans in it."""
    v = visit("runs")
    p = int(v.page.get_by_label("world size").first.input_value())
    with v.page.expect_download(timeout=WARM_TIMEOUT_S * 1000) as info:
        v.page.get_by_role("button", name=re.compile("Chrome trace")).click()
    path = artifacts / "run.chrome.json"
    info.value.save_as(path)
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {f"rank {r}" for r in range(p)}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(p)) and all(e["dur"] >= 0 for e in spans)
    assert {"forward", "backward"} <= {e["name"] for e in spans}, sorted(
        {e["name"] for e in spans}
    )[:20]


@pytest.mark.skipif("lessons" not in PAGE_FILES, reason="the Lessons page is not installed")
def test_viz_browser_lessons_answer_then_next(visit: Any, artifacts: Path) -> None:
    """Lesson 1: answer the first question (a choice) rightly, Next, the second (a number)
    wrongly."""
    v = visit("lessons?lesson=1&step=1")
    page = v.page
    assert page.get_by_text("step 1 of", exact=False).count() > 0
    page.locator('[data-testid="stRadio"] label', has_text="identical").first.click()
    wait_rendered(page, WARM_TIMEOUT_S)
    page.get_by_role("button", name="Check").click()
    page.locator('[data-testid="stAlertContentSuccess"]').wait_for(timeout=WARM_TIMEOUT_S * 1000)
    wait_rendered(page, WARM_TIMEOUT_S)
    assert "Right: identical" in page.locator('[data-testid="stAlertContentSuccess"]').inner_text()
    assert page.get_by_text("✅ every replica holds the same bits").count() == 1  # revealed
    v.screenshot(artifacts / "lessons-answered.png")
    page.get_by_role("button", name=re.compile(r"^\W*Next\W*$")).first.click()
    page.get_by_text("step 2 of", exact=False).first.wait_for(timeout=WARM_TIMEOUT_S * 1000)
    wait_rendered(page, WARM_TIMEOUT_S)
    assert "step=2" in page.url
    box = page.get_by_label("your answer")
    box.fill("2")
    box.press("Enter")
    wait_rendered(page, WARM_TIMEOUT_S)
    page.get_by_role("button", name="Check").click()
    page.locator('[data-testid="stAlertContentWarning"]').wait_for(timeout=WARM_TIMEOUT_S * 1000)
    wait_rendered(page, WARM_TIMEOUT_S)
    assert (
        "it is 3 (you said 2" in page.locator('[data-testid="stAlertContentWarning"]').inner_text()
    )
    assert v.exceptions() == [] and v.js_errors == []
    v.screenshot(artifacts / "lessons-after-next.png")


@pytest.mark.skipif("collectives" not in PAGE_FILES, reason="viz/pages/collectives.py is not "
                                                            "written yet")
def test_viz_browser_collectives_deep_link_short_names(visit: Any) -> None:
    """A lesson's link in its own words (?algorithm=tree&p=6) opens the page with those controls."""
    v = visit("collectives?algorithm=tree&p=6&n=12")
    # The page renames the short names and opens itself again with its own (st.switch_page): the
    # first run ends after the title, and under load the second can start later than
    # wait_rendered's confirmation. The round's caption is the second run's.
    has_caption = ("([sel, re]) => [...document.querySelectorAll(sel)]"
                   ".some(e => new RegExp(re, 'i').test(e.innerText))")
    v.page.wait_for_function(has_caption, arg=[TEXT_SELECTOR, ROUND_CAPTION.pattern],
                             timeout=COLD_TIMEOUT_S * 1000)
    wait_rendered(v.page, COLD_TIMEOUT_S)
    assert ROUND_CAPTION.search(_round_caption(v.page)).groups() == ("1", "6")
    assert "reduce up the tree" in _round_caption(v.page)
    query = v.page.evaluate("location.search")
    assert "coll_algorithm=tree" in query and "coll_p=6" in query and "&p=" not in query, query
    assert v.exceptions() == [] and v.js_errors == []
