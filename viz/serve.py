"""``dplab app``: serve the visualizer, the packaged ``viz/app.py``, with ``streamlit run``.

    dplab app                      # http://127.0.0.1:<a free port>, printed; Ctrl-C stops it
    dplab app --port 8501          # a fixed port (refused at once if it is taken)
    dplab app --host 0.0.0.0       # reachable from other machines: only where you mean it

The command lives here, beside the app it serves: imports run down the house (backends < viz),
so the command line finds ``add_app_parser`` by its entry point (``dplab.commands`` in
pyproject.toml) instead of importing it. The server is a child process: ``dplab app`` prints the
URL once the server answers its health check (on a loaded machine that is seconds after it
starts), then waits for it. The server's own output goes to stderr, so stdout is the one URL
line. Ctrl-C (exit 130) and SIGTERM (143) stop the server first, and a server whose ``dplab app``
was killed stops too: nothing is left behind. Before serving, the server imports what sessions
share (``preload``): the app's modules, and the pages added from above viz/ by entry point.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import importlib.util
import os
import pkgutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

from dplab.backends.launch.interrupt import interruptible
from dplab.backends.runs.uploads import TRACE
from dplab.reference.errors import ConfigError

__all__ = ["add_app_parser", "app_path", "free_port", "port_number", "streamlit_argv",
           "missing_viz_extra", "run_app", "preload", "prepare_server", "READY_TIMEOUT_S"]

VIZ_EXTRA = ("streamlit", "plotly")
MAX_UPLOAD_MB = -(-TRACE.max_bytes // (1 << 20))  # megabytes, as streamlit's option counts them
READY_TIMEOUT_S = 180.0  # the server's start, imports included, on a loaded machine
STOP_TIMEOUT_S = 10.0  # Ctrl-C or SIGTERM: how long the server has to stop before it is killed
# The heavy modules every session may need, imported once before the server serves: sessions'
# scripts run in threads, and two that import torch at once could see it half made ("partially
# initialized module 'torch' has no attribute 'set_num_threads'"). Not mpi4py.MPI: importing it
# starts MPI in the server. The pages added from above viz/ come through their entry points.
PRELOAD = ("numpy", "torch", "plotly.graph_objects", "plotly.express")
_NOT_MODULES = ("dplab.viz.app", "dplab.viz.pages")  # page scripts: they run in a session
_PARENT_ENV = "DPLAB_APP_PARENT"


def missing_viz_extra() -> list[str]:
    """The modules of the ``viz`` extra that are not installed (found, not imported: fast)."""
    return [name for name in VIZ_EXTRA if importlib.util.find_spec(name) is None]


def app_path() -> Path:
    """``viz/app.py`` of the installed dplab, wherever the install put it (editable or wheel).

    Returns:
        The app's file, resolved: the checkout's file, not its link in ``src/dplab``.

    Raises:
        ConfigError: the file is missing from the install, with how to reinstall.
    """
    path = Path(__file__).resolve().with_name("app.py")
    if not path.is_file():
        raise ConfigError(f"dplab's app file (viz/app.py) is not installed (no {path}): "
                          "reinstall dplab with pip install -e '.[viz]'")
    return path


def add_app_parser(sub: Any,
                   formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register ``dplab app`` on the subparsers ``sub``; the command line finds this function by its
    entry point (``dplab.commands``).

    Args:
        sub: the ``add_subparsers()`` of dplab's parser.
        formatter_class: the command line's help formatter (every command's help, one style).

    Returns:
        The command's parser; a namespace it parses carries ``run``: ``run_app``.
    """
    description = ("Serve the dplab app (streamlit run on the packaged viz/app.py, headless) and "
                   "print its URL; Ctrl-C stops it. Needs the viz extra: pip install 'dplab[viz]'.")
    a = sub.add_parser("app", help="open the visualizer (Streamlit) in your browser",
                       formatter_class=formatter_class, description=textwrap.fill(description, 88))
    a.add_argument("--port", type=port_number, default=0,
                   help="port to serve on; 0 picks a free one")
    a.add_argument("--host", default="127.0.0.1",
                   help="address to bind; loopback keeps the app on this machine "
                        "(0.0.0.0 shares it)")
    a.set_defaults(run=run_app)
    return a


def port_number(text: str) -> int:
    """``--port``: 0..65535, 0 for a free one (argparse turns the error into one line, exit 2)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0: a free one), got {value}")
    return value


def free_port(host: str) -> int:
    """A port the OS says is free on ``host`` now (streamlit binds it a moment later)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _check_port(host: str, port: int) -> None:
    """Refuse a taken port in one line, before streamlit's own longer complaint."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot serve on {host}:{port} ({e.strerror}): pick another --port, "
                          "or leave it out for a free one") from None


# ``streamlit run``, after ``prepare_server``, and except that the folder ``viz/pages/`` beside
# ``viz/app.py`` must not switch on Streamlit's old pages-directory mode: in it, a first request
# for a deep link (/collectives) runs that page alone, without app.py's st.navigation (wrong
# sidebar, every file listed). app.py's st.navigation turns the mode off itself, but only once some
# session has run app.py.
STREAMLIT_MAIN = ("import sys; from dplab.viz.serve import prepare_server; "
                  "prepare_server(); from streamlit.runtime.pages_manager import PagesManager; "
                  "PagesManager.uses_pages_directory = False; from streamlit.web.cli import main; "
                  "sys.argv[0] = 'streamlit'; sys.exit(main())")


def preload() -> None:
    """Import ``PRELOAD``, every module of ``dplab.viz`` (not the page scripts) and what each
    added page preloads (``AddedPage.preload``: the lessons' modules, not the exercises' stubs and
    solutions); what is not installed is skipped."""
    import dplab.viz
    from dplab.viz.added_pages import added_pages

    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    for found in pkgutil.walk_packages(dplab.viz.__path__, "dplab.viz.", onerror=lambda name: None):
        if not any(found.name.startswith(n) for n in _NOT_MODULES):
            importlib.import_module(found.name)
    for page in added_pages():
        page.preload()


def prepare_server() -> None:
    """In the server process, before streamlit: end with ``dplab app`` (Linux: a parent killed
    even by SIGKILL leaves no server behind), ``preload``, and start the upkeep that gives ended
    sessions' memory back (``dplab.viz.upkeep``)."""
    parent = int(os.environ.pop(_PARENT_ENV, "0") or 0)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:  # it died before the prctl
        raise SystemExit(0)
    preload()
    importlib.import_module("dplab.viz.upkeep").start()  # ended sessions give their memory back
    # `kill -USR1 <pid>` writes every thread's stack to the server's stderr (and a rank's, which
    # inherits it at fork): a stuck session can be read where it stands, with nothing installed
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def streamlit_argv(path: Path, host: str, port: int) -> list[str]:
    """The ``streamlit run`` command line: headless (no browser, no e-mail prompt), no telemetry,
    no file watcher (an installed app does not change under it), and uploads no larger than the
    largest file a page reads (a trace, ``uploads.TRACE``), not Streamlit's 200 MB."""
    return [sys.executable, "-c", STREAMLIT_MAIN, "run", str(path),
            "--server.headless", "true", "--server.address", host, "--server.port", str(port),
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--global.developmentMode", "false", "--server.maxUploadSize", str(MAX_UPLOAD_MB)]


def url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def run_app(a: argparse.Namespace) -> int:
    """Check, start the server, print the URL once it answers, wait for it. Returns 2 (with one
    line) when it cannot start, the server's exit code when it stops by itself, and exits 130 on
    Ctrl-C (143 on SIGTERM) once the server has stopped."""
    missing = missing_viz_extra()
    if missing:
        print(f"dplab app: error: the app needs the viz extra ({', '.join(missing)} missing): "
              "pip install 'dplab[viz]'", file=sys.stderr, flush=True)
        return 2
    try:
        path = app_path()
        port = a.port or free_port(a.host)
        _check_port(a.host, port)
    except (ConfigError, OSError) as e:
        reason = (
            e
            if isinstance(e, ConfigError)
            else f"cannot bind {a.host} ({e.strerror}): check --host"
        )
        print(f"dplab app: error: {reason}", file=sys.stderr, flush=True)
        return 2
    return interruptible("dplab app", _serve, streamlit_argv(path, a.host, port), url(a.host, port))


def _serve(argv: list[str], address: str) -> int:
    """Run the server (its stdout to our stderr); print ``address`` when it is ready; wait."""
    # glibc gives each thread that allocates its own arena, and Streamlit runs every session's
    # script in a thread of its own: memory freed in one arena serves no other, so the server kept
    # growing visitor after visitor. The user's own MALLOC_ARENA_MAX wins.
    env = {"MALLOC_ARENA_MAX": "2", **os.environ, _PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env)
    try:
        if not _ready(proc, address):
            if proc.poll() is None:
                print(f"dplab app: error: the server did not answer {address} within "
                      f"{READY_TIMEOUT_S:g} s (its output is above): is the machine that busy?",
                      file=sys.stderr, flush=True)
                return 1
            print(f"dplab app: error: the server ended with exit code {proc.returncode} before it "
                  "served (its output is above)", file=sys.stderr, flush=True)
            return 2
        print(f"dplab app: {address} (Ctrl-C stops it)", flush=True)
        return proc.wait()
    finally:
        _stop(proc)


def _ready(proc: subprocess.Popen, address: str) -> bool:
    """Poll the server's health endpoint until it answers "ok"; False if it ends or times out."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{address}/_stcore/health", timeout=2) as answer:
                if answer.read().strip() == b"ok":
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server (it has Ctrl-C already when it shares our terminal): SIGINT, then SIGKILL
    after ``STOP_TIMEOUT_S``; then it is reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
