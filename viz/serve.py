"""``dplab app``: serve the visualizer, the packaged ``viz/app.py``, with ``streamlit run``.

    dplab app                      # http://127.0.0.1:<a free port>, printed; Ctrl-C stops it
    dplab app --port 8501          # a fixed port (refused at once if it is taken)
    dplab app --host 0.0.0.0       # reachable from other machines: only where you mean it

The command lives here, beside the app it serves: imports run down the house (backends < viz),
so the command line finds ``add_app_parser`` by its entry point (``dplab.commands`` in
pyproject.toml) instead of importing it. The process becomes streamlit (``os.execv``), so Ctrl-C
and SIGTERM reach the server itself and nothing is left behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

from dplab.backends.runs.uploads import TRACE
from dplab.reference.errors import ConfigError

__all__ = ["add_app_parser", "app_path", "free_port", "port_number", "streamlit_argv",
           "missing_viz_extra", "run_app"]

VIZ_EXTRA = ("streamlit", "plotly")
MAX_UPLOAD_MB = -(-TRACE.max_bytes // (1 << 20))  # megabytes, as streamlit's option counts them


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


# ``streamlit run``, except that the folder ``viz/pages/`` beside ``viz/app.py`` must not switch on
# Streamlit's old pages-directory mode: in it, a first request for a deep link (/collectives) runs
# that page alone, without app.py's st.navigation (wrong sidebar, every file listed). app.py's
# st.navigation turns the mode off itself, but only once some session has run app.py.
STREAMLIT_MAIN = ("import sys; from streamlit.runtime.pages_manager import PagesManager; "
                  "PagesManager.uses_pages_directory = False; from streamlit.web.cli import main; "
                  "sys.argv[0] = 'streamlit'; sys.exit(main())")


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
    """Check, print the URL, then become streamlit. Returns 2 (with one line) when it cannot start."""
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
        reason = e if isinstance(e, ConfigError) else f"cannot bind {a.host} ({e.strerror}): check --host"
        print(f"dplab app: error: {reason}", file=sys.stderr, flush=True)
        return 2
    print(f"dplab app: {url(a.host, port)} (Ctrl-C stops it)", flush=True)
    argv = streamlit_argv(path, a.host, port)
    os.execv(argv[0], argv)
    return 0  # not reached: execv replaces this process
