"""``dplab app``: it serves the packaged app on loopback, and says in one line when it cannot."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dplab.backends.cli.commands import main
from dplab.viz import serve

ROOT = Path(__file__).resolve().parents[1]
DPLAB = [sys.executable, "-m", "dplab.backends.cli"]


def test_help_names_port_and_host():
    proc = subprocess.run([*DPLAB, "app", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (
        "--port" in proc.stdout
        and "--host" in proc.stdout
        and "(default: 127.0.0.1)" in proc.stdout
    )


def test_app_path_is_the_packaged_file_and_other_commands_load_no_viz():
    """The command line finds ``dplab app`` by its entry point: parsing train loads no viz."""
    code = ("import sys; from dplab.backends.cli.args import build_parser; "
            "build_parser('train').parse_args(['train']); "
            "up = ('dplab.viz', 'dplab.lessons'); print(sorted(m for m in sys.modules "
            "if m.startswith(up))); "
            "from dplab.viz.serve import app_path; print(app_path())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr
    imported, path = proc.stdout.splitlines()
    assert Path(path) == ROOT / "viz" / "app.py"
    assert imported == "[]"


def test_streamlit_argv_is_headless_on_the_given_address():
    argv = serve.streamlit_argv(Path("/x/app.py"), "127.0.0.1", 8123)
    assert (
        argv[1] == "-c"
        and "uses_pages_directory = False" in argv[2]
        and argv[3:5] == ["run", "/x/app.py"]
    )
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--server.headless"] == "true"
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.port"] == "8123"
    assert flags["--browser.gatherUsageStats"] == "false"
    assert flags["--server.maxUploadSize"] == "64"  # the largest trace a page reads, not 200 MB


def test_missing_viz_extra_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "plotly", None)  # find_spec answers None, as if not installed
    assert main(["app"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "viz extra (plotly missing)" in err
        and "pip install 'dplab[viz]'" in err
    )


def test_a_taken_port_is_one_line_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["app", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot serve on 127.0.0.1:{port}" in err and "--port" in err


@pytest.mark.parametrize("port", ["-1", "70000", "http"])
def test_a_bad_port_is_refused_by_the_parser(port):
    proc = subprocess.run(
        [*DPLAB, "app", "--port", port], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--port" in proc.stderr


# slow: test_hardening_app's default cases start this same server from / and check its health
@pytest.mark.slow
def test_dplab_app_serves_health_on_a_free_loopback_port():
    """The real thing: start ``dplab app``, read the URL it prints, poll /_stcore/health, stop
    it."""
    proc = subprocess.Popen(
        [*DPLAB, "app"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("dplab app: http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[2]
        deadline, body = time.monotonic() + 30, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    body = r.read().decode()
                    break
            except OSError:
                time.sleep(0.2)
        assert body == "ok", f"no health answer from {url}: exit {proc.poll()}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None
