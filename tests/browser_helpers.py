"""Machinery for the browser tests: find Chromium and playwright, serve ``dplab app``, wait for a
render.

    pytest -q -m browser tests/test_viz_browser.py              # screenshots under a tmp dir
    DPLAB_ARTIFACTS=/tmp/shots pytest -q -m browser tests/test_viz_browser.py  # under /tmp/shots

The browser is Debian's ``chromium`` (``apt-get install chromium``; ``.ci/run`` installs it),
driven by the ``playwright`` package: ``playwright install`` downloads its own browser build,
which this project's machines cannot fetch, so we launch the system one by path. A missing
browser or package skips with the reason, unless ``DPLAB_REQUIRE_BROWSER=1`` (CI sets it):
there a skip would hide that the app was never opened, so it fails instead.

"Rendered" means what a person waiting for the page would say: Streamlit's script has finished
(``data-test-script-state="notRunning"`` on a connected app), no spinner is showing, no element
is still a placeholder (``stSkeleton``: plotly charts and dataframes are lazy-loaded components
that arrive up to two seconds after the script has finished) and every plotly chart has drawn its
SVG; and all of that still holds CONFIRM_S later (a rerun the first run triggers starts from a
finished state too).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CHROMIUM_ARGS", "AppServer", "browser_missing", "chromium_path", "free_port",
           "require_browser", "wait_rendered", "RENDERED_JS", "EXCEPTION_SELECTOR"]

CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                 # /tmp, not /dev/shm: the tests that count dplab's segments
                 "--disable-dev-shm-usage")
EXCEPTION_SELECTOR = '[data-testid="stException"]'
HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
CONFIRM_S = 0.3

# True once the page is rendered (see the module docstring); evaluated in the page by
# wait_for_function.
RENDERED_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  if (!app || app.dataset.testScriptState !== 'notRunning' || app.dataset.testConnectionState !==
  'CONNECTED')
    return false;
  if (document.querySelector('[data-testid="stSpinner"], [data-testid="stSkeleton"]')) return false;
  const charts = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')];
  return charts.every(c => c.querySelector('.js-plotly-plot .main-svg'));
}"""


def chromium_path() -> str | None:
    """The Chromium binary: ``DPLAB_CHROMIUM`` if set, else Debian's ``chromium`` on the PATH."""
    given = os.environ.get("DPLAB_CHROMIUM")
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (None when they can): the reason a skip prints."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed: pip install -e '.[test]' (or pip install playwright)"
    if chromium_path() is None:
        return ("no chromium on the PATH (or DPLAB_CHROMIUM): apt-get install -y chromium "
                "(playwright's own download cannot reach its servers here)")
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        return "the viz extra is not installed: pip install -e '.[viz]'"
    return None


def require_browser() -> bool:
    """CI's switch: a missing browser fails the run instead of skipping
    (DPLAB_REQUIRE_BROWSER=1)."""
    return os.environ.get("DPLAB_REQUIRE_BROWSER", "") not in ("", "0")


def free_port() -> int:
    """A loopback port the OS says is free now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AppServer:
    """``dplab app --port N`` as a subprocess in its own session, so stopping it stops all of it.

    Its output goes to ``log`` (a pipe nobody reads would fill and stall the server), and is
    quoted in the error when it does not come up."""

    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def server_pid(self) -> int:
        """The streamlit server: ``dplab app``'s one child (it prints the URL and waits for it)."""
        kids = [int(c) for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
        return kids[0] if kids else self.proc.pid

    def start(self) -> AppServer:
        dplab = Path(sys.executable).with_name("dplab")
        argv = [str(dplab) if dplab.is_file() else "dplab", "app", "--port", str(self.port)]
        t0 = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = t0 + HEALTH_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dplab app exited with {self.proc.returncode} before serving:\n"
                                   f"{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        self.started_s = time.perf_counter() - t0
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"dplab app did not answer /_stcore/health in {HEALTH_TIMEOUT_S:.0f} "
                           f"s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it if it has not gone in STOP_TIMEOUT_S."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session: the group is the server's own, id = its pid
    except ProcessLookupError:
        pass


def wait_rendered(page: Any, timeout_s: float) -> float:
    """Block until ``page`` is rendered (RENDERED_JS, confirmed CONFIRM_S later), or raise
    playwright's TimeoutError. Returns the seconds from the call to the confirmed render's first
    sighting."""
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while True:
        left_ms = max(1.0, (deadline - time.perf_counter()) * 1000)
        page.wait_for_function(RENDERED_JS, timeout=left_ms, polling=50)
        seen = time.perf_counter() - t0
        page.wait_for_timeout(CONFIRM_S * 1000)
        if page.evaluate(RENDERED_JS):
            return seen
