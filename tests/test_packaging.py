"""The install puts dplab's folders under one name, ``dplab``, and nothing at the top level.

PyPI has distributions named ``backends``, ``reference`` and ``viz``; if dplab installed those
names, whichever came second would silently shadow the other. These tests run Python outside the
repository (so the folders in the checkout cannot be found by accident) and check both the
editable install the README uses and a normal install from a built wheel.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("reference", "backends", "viz", "lessons")

PROBE = """
import importlib, sys
for name in {folders!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        sys.exit(f"import {{name}} worked: dplab must not install a top-level {{name!r}}")
for name in {folders!r}:
    mod = importlib.import_module("dplab." + name)
    print(name, mod.__file__)
from dplab.backends import World, allreduce, launch  # the short import of the README
from dplab.backends.runs import RunSpec, run_train
"""


def _probe(cwd: Path, env: dict | None = None) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(folders=FOLDERS)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


def test_the_installed_names_live_under_dplab_only(tmp_path):
    """This test run's own install (editable in CI): ``import backends`` fails outside the
    repository, ``import dplab.backends`` works and is the checkout's folder."""
    files = _probe(tmp_path)
    for name in FOLDERS:
        assert Path(files[name]).resolve().is_relative_to(ROOT / name), files[name]


@pytest.mark.slow  # slow: pip builds and installs a wheel (8 CPU-s); the names above run by default
def test_a_wheel_installs_everything_under_dplab(tmp_path):
    """A normal (non-editable) install, from the wheel pip builds: every file is under ``dplab/``
    (or the dist-info), and the installed copy imports by its dplab names only."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0:
        pytest.skip(f"cannot build a wheel here (pip needs setuptools>=77 from the index): "
                    f"{build.stderr.strip().splitlines()[-1:]}")
    wheel = next(tmp_path.glob("dplab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dplab"}, tops
    for name in FOLDERS:
        assert f"dplab/{name}/__init__.py" in names
    assert (
        "dplab/reference/algorithms/ring.py" in names and "dplab/backends/cli/commands.py" in names
    )
    packages = {f"dplab/{init.relative_to(ROOT).as_posix()}" for name in FOLDERS
                for init in (ROOT / name).rglob("__init__.py")}
    assert packages <= set(names), (
        f"packages left out of the wheel: {sorted(packages - set(names))}"
    )

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    # -I would drop the venv's numpy; instead put the wheel's copy first on the path.
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    files = _probe(run_dir, env)
    for name in FOLDERS:
        assert Path(files[name]).resolve().is_relative_to(site / "dplab" / name), files[name]


def test_the_installed_entry_points_are_the_declared_ones():
    """``dplab app``, ``dplab lesson`` and the app's Lessons page live above the code that starts
    them and are found by entry points: the install must declare what pyproject.toml does, and
    each must load (a stale install: pip install -e . again)."""
    from importlib.metadata import entry_points

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(declared) == {"dplab.commands", "dplab.app_pages"}, declared
    for group, entries in declared.items():
        installed = {ep.name: ep for ep in entry_points(group=group)}
        assert {name: ep.value for name, ep in installed.items()} == entries, \
            f"the installed dplab declares other {group} entry points: pip install -e ."
        for ep in installed.values():
            assert ep.load() is not None, ep
