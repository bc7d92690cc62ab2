"""The node layout across real hosts: 2 namespace hosts x 2 ranks, mpiexec and torchrun (root only).

Each launcher's ranks read two hosts of two (MPI by its shared-memory split under hydra, torch by
torchrun's LOCAL_WORLD_SIZE): ``dplab train --algorithm hierarchical`` runs hierarchical:2, as the
trace's all-reduce spans say (on one host it would stay the simulated "hierarchical"), and lands on
the single-device parameters; ``hierarchical:3`` is refused in one line before any rank starts
(under mpiexec here; torchrun's environment gets the same check in ``tests/test_node_layout.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import hosts
import numpy as np
import pytest
from hosts import finish, mpiexec, torchrun

from dplab.backends.cli.args import build_parser
from dplab.backends.cli.commands import _train_config
from dplab.reference.train.single import train_single

pytestmark = [pytest.mark.hosts, pytest.mark.mpi, pytest.mark.torch]
cluster = hosts.cluster  # the fixture: 2 hosts x 2 ranks

TRAIN = ["train", "--steps", "3", "--hidden", "16", "--num-samples", "128", "--global-batch", "32"]
REFUSED = ("dplab train: error: hierarchical:3 puts 3 ranks in a node, but the launcher put 2 "
           "hosts of 2 ranks: use --algorithm hierarchical (g from the hosts) or hierarchical:2")


def _hierarchical_run(done: list[tuple[int, str, str]], tmp_path: Path, backend: str) -> None:
    for code, _, err in done:
        assert code == 0, err[-3000:]
    row = json.loads((tmp_path / "rows.json").read_text())["rows"][0]
    ref = train_single(_train_config(build_parser().parse_args(TRAIN), None)).params
    scale = max(1.0, float(np.max(np.abs(ref))))
    assert (row["backend"], row["world_size"], row["algorithm"], row["ranks_identical"]) == (
        backend, 4, "hierarchical", True), row
    assert row["max_abs_diff_vs_single"] <= 1e-10 * scale, row
    assert np.max(np.abs(np.load(tmp_path / "params.npy") - ref)) <= 1e-10 * scale
    events = json.loads((tmp_path / "trace.json").read_text())["events"]
    spans = {(e["rank"], e["algorithm"]) for e in events if e["kind"] == "allreduce"}
    assert spans == {(r, "hierarchical:2") for r in range(4)}  # g from comm.hosts = (0, 0, 1, 1)


def _refused(done: list[tuple[int, str, str]]) -> None:
    assert all(code != 0 for code, _, _ in done)
    lines = [line for _, _, err in done for line in err.splitlines() if line.startswith("dplab ")]
    assert lines == [REFUSED]


ARGS = [*TRAIN, "--algorithm", "hierarchical", "--json", "rows.json", "--save-params", "params.npy",
        "--trace", "trace.json"]


def test_mpiexec_hierarchical_takes_g_from_the_hosts(cluster, tmp_path):
    _hierarchical_run(
        finish(mpiexec(cluster, [*ARGS, "--backend", "mpi"], tmp_path)), tmp_path, "mpi"
    )
    refuse = ["train", "--backend", "mpi", "--algorithm", "hierarchical:3"]
    _refused(finish(mpiexec(cluster, refuse, tmp_path)))


def test_torchrun_hierarchical_takes_g_from_the_hosts(cluster, tmp_path):
    """The refusal comes from the same check of torchrun's environment before any rank starts
    (tests/test_node_layout.py); a torchrun job that only refuses costs 15 s of rendezvous here."""
    done = finish(torchrun(cluster, [*ARGS, "--backend", "torch"], "layout", tmp_path))
    _hierarchical_run(done, tmp_path, "torch")
