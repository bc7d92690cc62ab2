"""What the this-machine model adds to the simulator, each on a small cluster of its own: cores as
a pool (p ranks on fewer cores take p / cores times as long while all of them work, and run at
full speed while the others wait), a transport's per-algorithm terms (dplab tune's fit of each
algorithm alone, gamma folded in), and the parameter server's update on its clock."""

from __future__ import annotations

import json

import pytest

from dplab.backends.launch.world import launch
from dplab.backends.sim.timing import collective_time
from dplab.reference.cluster import cluster_from_dict

MIB = 1 << 20


def _cores(pool: bool, algorithms: dict | None = None) -> dict:
    intra = {"alpha_us": 10, "bandwidth_gb_s": 2, "on_device": True}
    return {"name": "two-cores", "nodes": 1, "ranks_per_node": 8, "devices_per_node": 2,
            "device_pool": pool, "reduce_gb_s": 4,
            "device": {"tflop_s": 0.01, "memory_gb": 8, "memory_gb_s": 10},
            "links": {"intra": intra | ({"algorithms": algorithms} if algorithms else {})}}


def _busy(comm, seconds):
    """Every rank works ``seconds``."""
    t0 = comm.now()
    comm.work(seconds)
    return comm.now() - t0


def _half_wait(comm, seconds):
    """Ranks 0 and 1 work ``seconds`` while the others wait for them."""
    t0 = comm.now()
    if comm.rank < 2:
        comm.work(seconds)
    comm.barrier()
    return comm.now() - t0


def test_a_pool_of_two_cores_runs_four_busy_ranks_at_half_speed():
    c = cluster_from_dict(_cores(True))
    assert launch(_busy, 2, backend="sim", cluster=c, args=(0.1,)) == [pytest.approx(0.1)] * 2
    # four busy ranks on two cores: they queue (as ports do), so the last is done at 2 x 0.1,
    # when an operating system's fair share would finish all four
    took = launch(_busy, 4, backend="sim", cluster=c, args=(0.1,))
    assert sorted(took) == [pytest.approx(0.1)] * 2 + [pytest.approx(0.2)] * 2
    # ranks 0 and 1 share no core while 2 and 3 wait: a pool, not rank r on core r % 2
    took = launch(_half_wait, 4, backend="sim", cluster=c, args=(0.1,))
    assert max(took) < 0.1 + 1e-3
    robin = launch(_half_wait, 4, backend="sim", cluster=cluster_from_dict(_cores(False)),
                   args=(0.1,))
    assert max(robin) < 0.1 + 1e-3  # 0 and 1 on cores 0 and 1 either way
    took = launch(_busy, 3, backend="sim", cluster=c, args=(0.1,))
    assert sorted(took) == [pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.2)]


def test_an_algorithm_with_its_own_terms_is_priced_by_them_without_gamma():
    n, alpha, beta, gamma = 4 * MIB, 10e-6, 1 / 2e9, 1 / 4e9
    c = cluster_from_dict(_cores(True, {"tree": {"alpha_us": 3, "bandwidth_gb_s": 5}}))
    # tree on 2 ranks: the whole buffer up (reduced), then back down, one message each way
    assert collective_time(c, 2, "tree", n).seconds == pytest.approx(2 * (3e-6 + n / 5e9))
    # ring keeps the link's terms, and gamma on the half it reduces
    ring = collective_time(c, 2, "ring", n).seconds
    assert ring == pytest.approx(2 * (alpha + n / 2 * beta) + n / 2 * gamma)
    assert c.intra.for_algorithm("tree").alpha == 3e-6 and c.intra.for_algorithm("ring") is c.intra


def test_a_bad_algorithm_term_says_which(tmp_path):
    from dplab.reference.errors import ConfigError

    doc = _cores(True, {"native": {"alpha_us": 3, "bandwidth_gb_s": 0}})
    with pytest.raises(ConfigError, match=r"links.intra.algorithms.native.bandwidth_gb_s is 0"):
        cluster_from_dict(doc, "c")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_cores(True) | {"device_pool": "yes"}))
    with pytest.raises(ConfigError, match="device_pool is 'yes'"):
        cluster_from_dict(json.loads(path.read_text()), "c")


def test_the_parameter_servers_update_takes_time_on_its_device(tmp_path):
    from dplab.backends.cli.commands import main
    from dplab.reference.flops import optimizer_ops

    path, trace = tmp_path / "c.json", tmp_path / "t.json"
    path.write_text(json.dumps(_cores(False)))
    argv = ["train", "--backend", "sim", "--cluster", str(path), "--mode", "async",
            "--world-size", "2", "--steps", "2", "--optimizer", "sgd", "--in-dim", "16",
            "--hidden", "32,32", "--out-dim", "4", "--trace", str(trace)]
    assert main(argv) == 0
    doc = json.loads(trace.read_text())
    applies = [e for e in doc["events"] if e["kind"] == "apply"]
    n = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4  # the MLP 16-32-32-4
    ops = [(float(n), 8.0 * 2 * n)] + optimizer_ops("sgd", n, 8)  # one gradient, then the step
    want = sum(max(f / 1e10, b / 10e9) for f, b in ops)
    assert applies and all(
        (e["t_end_ns"] - e["t_start_ns"]) == pytest.approx(want * 1e9, abs=2) for e in applies)
