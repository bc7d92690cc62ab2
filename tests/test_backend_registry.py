"""The backend registry (``dplab.backends.registry``) is what the launcher asks, not string
branches.

Each entry names a transport, says whether it is installed, how its ranks start and how a forked
rank connects; a world of every installed backend starts from its entry alone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dplab.backends import registry
from dplab.backends.launch import ranks, world
from dplab.backends.launch.world import launch
from dplab.reference.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def job_who(comm):
    return comm.backend, comm.rank, comm.world_size


def test_a_world_of_each_backend_starts_from_its_entry(backend):
    """The rank's communicator reports the entry's name: the entry chose the transport."""
    assert launch(job_who, 2, backend=backend) == [(backend, 0, 2), (backend, 1, 2)]


def test_every_entry_says_how_its_ranks_start():
    assert world.BACKENDS == tuple(registry.BACKENDS)
    for name, entry in registry.BACKENDS.items():
        assert entry.name == name and entry.start in ranks._STARTS
        assert (entry.prepare is not None) == entry.forked, name
        assert entry.available() is None or isinstance(entry.available(), str)
        assert entry.gpu in ("never", "always", "device"), name
    assert registry.entry("local").available() is None


def test_an_unknown_backend_names_the_registry():
    with pytest.raises(
        ConfigError, match="unknown backend 'nccl': choose one of local, mpi, torch"
    ):
        world.check_backend("nccl")


def test_the_registry_loads_no_engine():
    """Listing the backends and asking the local one imports no MPI and no torch."""
    probe = ("from dplab.backends.registry import BACKENDS; import json, sys; "
             "BACKENDS['local'].available()\nprint(json.dumps(sorted(m for m in sys.modules if m "
             "in ('torch', 'mpi4py', 'dplab.backends.mpi.comm') or "
             "m.startswith('dplab.backends.torchdist'))))")
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("path", ["backends/launch/world.py", "backends/launch/ranks.py"])
def test_the_launcher_branches_on_entries_not_on_names(path):
    source = (ROOT / path).read_text()
    assert not re.findall(r"backend\s*[!=]=\s*[\"']", source), path


def test_launch_cli_runs_bench_and_nn_ask_the_registry_not_the_name():
    """No ``backend == "..."`` branch outside the backends' own folders:
    a new backend is an entry."""
    branch = re.compile(r"""backend\s*(==|!=|in|not in)\s*[(\["']""")
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for folder in ("launch", "cli", "runs", "bench", "nn", "fastpath")
            for path in sorted((ROOT / "backends" / folder).rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not hits, hits
