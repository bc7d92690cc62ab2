"""The engines' launchers across hosts: 2 hosts x 2 ranks in network namespaces (root only).

torchrun with c10d rendezvous, one launcher per host, over gloo; MPICH's mpiexec from host 0, its
hydra proxies entering the other host through ``Cluster.enter_script``, MPICH's ch4 over ofi/tcp.
``dplab train`` lands on the single-device parameters (float64, 1e-10 relative) with every replica
identical, its bytes having crossed the link between the hosts; ``compare`` and ``bench`` run on
the launcher's ranks; the local backend refuses to span hosts, in one line.
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
from dplab.backends.hosts.netns import Cluster
from dplab.reference.train.single import train_single

pytestmark = [pytest.mark.hosts, pytest.mark.mpi, pytest.mark.torch]
cluster = hosts.cluster  # the fixture: 2 hosts x 2 ranks

TRAIN = ["train", "--steps", "4", "--hidden", "16", "--num-samples", "256", "--global-batch", "32"]
REL = 1e-10


def _link_bytes(c: Cluster, host: int) -> int:
    """Bytes host ``host`` sent and received over its link (the bridge end of its veth)."""
    stats = Path(f"/sys/class/net/{c.veths[host]}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def _check_train(tmp_path: Path, backend: str) -> dict:
    """The row says 4 identical replicas at the single-device parameters; the saved ones agree."""
    row = json.loads((tmp_path / "rows.json").read_text())["rows"][0]
    ref = train_single(_train_config(build_parser().parse_args(TRAIN), None)).params
    params = np.load(tmp_path / "params.npy")
    scale = max(1.0, float(np.max(np.abs(ref))))
    assert (row["backend"], row["world_size"], row["ranks_identical"]) == (backend, 4, True), row
    assert row["max_abs_diff_vs_single"] <= REL * scale, row
    assert params.dtype == np.float64 and np.max(np.abs(params - ref)) <= REL * scale
    return row


def _ok(done: list[tuple[int, str, str]]) -> str:
    """Every launcher exited 0; host 0's output (the only one that prints)."""
    for code, _, err in done:
        assert code == 0, err[-3000:]
    assert all(out == "" for _, out, _ in done[1:])  # only rank 0 prints, and it is on host 0
    return done[0][1]


def _cli_lines(done: list[tuple[int, str, str]]) -> list[str]:
    return [line for _, _, err in done for line in err.splitlines() if line.startswith("dplab ")]


# -- torchrun ------------------------------------------------------------------------------------

def test_torchrun_train_across_hosts_equals_single_device(cluster, tmp_path):
    before = _link_bytes(cluster, 1)
    args = [*TRAIN, "--backend", "torch", "--json", "rows.json", "--save-params", "params.npy"]
    out = _ok(finish(torchrun(cluster, args, "train", tmp_path)))
    _check_train(tmp_path, "torch")
    assert "torch  sync       ring           4" in out
    assert _link_bytes(cluster, 1) - before > 20_000  # the gradients crossed between the hosts


def test_torchrun_compare_and_bench_across_hosts(cluster, tmp_path):
    compare = [
        "compare",
        "--backends",
        "torch",
        "--world-sizes",
        "4",
        "--algorithms",
        "ring,native",
        "--steps",
        "3",
        "--json",
        "c.json",
    ]
    out = _ok(finish(torchrun(cluster, compare, "compare", tmp_path)))
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["algorithm"], r["world_size"], r["ranks_identical"]) for r in rows] == [
        ("ring", 4, True), ("native", 4, True)]
    assert all(r["max_abs_diff_vs_single"] <= 1e-12 for r in rows) and out.count("torch  sync") == 2
    bench = [
        "bench",
        "--backends",
        "torch",
        "--world-sizes",
        "4",
        "--sizes",
        "64K",
        "--algorithms",
        "ring",
        "--target-seconds",
        "0.05",
        "--reps",
        "2",
        "--json",
        "b.json",
    ]
    out = _ok(finish(torchrun(cluster, bench, "bench", tmp_path)))
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["algorithm"], r["world_size"], r["bytes"]) for r in rows] == [("ring", 4, 65536),
                                                                            ("memcpy", 4, 65536)]
    assert rows[0]["time_us"] > 0 and "torch       ring           4" in out


def test_torchrun_local_backend_across_hosts_is_refused_in_one_line(cluster, tmp_path):
    done = finish(torchrun(cluster, ["train", "--backend", "local"], "local", tmp_path))
    assert all(code != 0 for code, _, _ in done)
    assert _cli_lines(done) == ["dplab train: error: the local backend runs on one host, but this "
                                "torchrun job has 4 ranks, 2 of them on this host: use --backend "
                                "torch or mpi"]


# -- mpiexec -------------------------------------------------------------------------------------

def test_mpiexec_train_across_hosts_equals_single_device(cluster, tmp_path):
    before = _link_bytes(cluster, 1)
    args = [*TRAIN, "--backend", "mpi", "--json", "rows.json", "--save-params", "params.npy"]
    out = _ok(finish(mpiexec(cluster, args, tmp_path)))
    _check_train(tmp_path, "mpi")
    assert "mpi  sync       ring           4" in out
    assert _link_bytes(cluster, 1) - before > 20_000


def test_mpiexec_compare_and_bench_across_hosts(cluster, tmp_path):
    out = _ok(
        finish(
            mpiexec(
                cluster,
                [
                    "compare",
                    "--backends",
                    "mpi",
                    "--world-sizes",
                    "4",
                    "--algorithms",
                    "tree,native",
                    "--steps",
                    "3",
                    "--json",
                    "c.json",
                ],
                tmp_path,
            )
        )
    )
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["algorithm"], r["world_size"], r["ranks_identical"]) for r in rows] == [
        ("tree", 4, True), ("native", 4, True)]
    assert all(r["max_abs_diff_vs_single"] <= 1e-12 for r in rows) and out.count("mpi  sync") == 2
    bench = ["bench", "--backends", "mpi", "--world-sizes", "4", "--sizes", "64K", "--algorithms",
             "ring,native", "--target-seconds", "0.05", "--reps", "2", "--json", "b.json"]
    out = _ok(finish(mpiexec(cluster, bench, tmp_path)))
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["algorithm"], r["world_size"]) for r in rows] == [
        ("ring", 4),
        ("native", 4),
        ("memcpy", 4),
    ]
    assert all(r["time_us"] > 0 for r in rows) and "mpi     native           4" in out


def test_mpiexec_grid_of_other_world_sizes_is_one_line(cluster, tmp_path):
    done = finish(mpiexec(cluster, ["compare", "--backends", "mpi"], tmp_path))
    assert done[0][0] == 2
    assert _cli_lines(done) == ["dplab compare: error: the launcher started 4 ranks: give "
                                "--world-sizes 4 (not the default 1,2,3,4)"]


def test_mpiexec_local_backend_across_hosts_is_refused_in_one_line(cluster, tmp_path):
    done = finish(mpiexec(cluster, ["train", "--backend", "local"], tmp_path))
    assert done[0][0] != 0
    assert _cli_lines(done) == ["dplab train: error: the local backend runs on one host, but this "
                                "mpiexec job has 4 ranks, 2 of them on this host: use --backend "
                                "torch or mpi"]
