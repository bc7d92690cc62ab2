"""The sim backend's clock: what advances it, by how much, and what it reports when nothing can.

Time passes only by the model: a message's alpha + m beta, gamma per reduced byte, an operation's
roofline on its device (queued where ranks share one), a sleep; threads a rank starts, their queues
and their clocks live on the same virtual time. A world where every rank waits is reported at once.
"""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time

import numpy as np
import pytest

from dplab.backends.launch.world import RankError, launch
from dplab.reference.cluster import cluster, cluster_from_dict, load_cluster
from dplab.reference.errors import ConfigError


def _clock_reads(comm):
    t0 = comm.now()
    time.sleep(0.25)  # virtual: a quarter of a second on the rank's clock, none of the host's
    t1, p1 = comm.now(), time.perf_counter()
    return t0, t1, p1


def test_sleep_and_perf_counter_are_the_ranks_virtual_clock():
    t0, t1, p1 = launch(_clock_reads, 2, backend="sim", cluster="dgx-h100")[0]
    assert t1 - t0 == pytest.approx(0.25, abs=1e-12) and p1 == t1


def _thread_and_queue(comm):
    q: queue.Queue = queue.Queue()

    def worker():
        time.sleep(1.5)  # the comm thread's own clock starts at its parent's
        q.put(comm.now())

    t = threading.Thread(target=worker)
    t.start()
    got = q.get()  # the main thread waits in virtual time for the worker's put
    t.join()
    return got, comm.now()


def test_a_thread_a_rank_starts_lives_on_its_clock():
    for put, after in launch(_thread_and_queue, 2, backend="sim", cluster="dgx-h100"):
        assert put == pytest.approx(1.5) and after == pytest.approx(1.5)


def _compute(comm, flops, nbytes):
    t0 = comm.now()
    comm.compute([(flops, nbytes)], "float32")
    comm.synchronize()  # where the device runs behind its host (h200: rank threads), wait
    return comm.now() - t0


def test_compute_costs_its_roofline_on_the_device():
    h100 = cluster("dgx-h100").device
    flops, nbytes = 67e12 * 1e-3, 3.35e12 * 1e-4  # 1 ms of FP32 FLOPs, 0.1 ms of memory
    took = launch(_compute, 2, backend="sim", cluster="dgx-h100", args=(flops, nbytes))
    assert took == [pytest.approx(flops / h100.rate("float32"))] * 2
    took = launch(_compute, 1, backend="sim", cluster="dgx-h100", args=(1.0, 1.0))[0]
    assert took == pytest.approx(h100.op_overhead_s)  # a tiny operation: the launch's least time


def test_ranks_on_one_device_take_turns():
    launch_s = 7e-6 + 12.4e-6  # h200: an operation's launch, and one rank thread's contention
    one = launch(_compute, 1, backend="sim", cluster="h200", args=(67e12 * 1e-3, 0.0))[0]
    assert one == pytest.approx(launch_s + 1e-3)  # the host launches, the device computes after
    both = sorted(launch(_compute, 2, backend="sim", cluster="h200", args=(67e12 * 1e-3, 0.0)))
    assert both[1] == pytest.approx(both[0] + 1e-3)  # one GPU: the second kernel waits


def test_a_straggler_named_in_the_cluster_computes_slower(tmp_path):
    data = json.loads(cluster("dgx-h100").source and _preset_text("dgx-h100"))
    data |= {"name": "slow-3", "stragglers": [{"rank": 3, "compute": 4.0}]}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(data))
    took = launch(_compute, 4, backend="sim", cluster=str(path), args=(67e12 * 1e-3, 0.0))
    assert took[3] == pytest.approx(4 * took[0]) and took[:3] == [took[0]] * 3


def _preset_text(name: str) -> str:
    from dplab.reference.cluster import PRESET_DIR

    return (PRESET_DIR / f"{name}.json").read_text()


def _lonely(comm):
    if comm.rank == 0:
        comm.recv(np.zeros(4), 1, tag=7)  # rank 1 never sends
    return comm.rank


def test_a_world_where_every_rank_waits_is_reported_at_once():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 waits for a message from rank 1 \(tag 7\)"):
        launch(_lonely, 2, backend="sim", cluster="dgx-h100", timeout=60)
    assert time.monotonic() - t0 < 20  # not the 60 s timeout: the engine knows nobody will send


def test_every_preset_loads_and_cites_its_sources():
    from dplab.reference.cluster import CLUSTERS

    assert {"this-machine", "h200", "dgx-h100", "pcie-4x4090", "cloud-2x25g"} <= set(CLUSTERS)
    for name in CLUSTERS:
        c = cluster(name)
        assert c.sources and all(len(s) > 20 for s in c.sources), name
    assert cluster("dgx-h100x64").size == 512 and cluster("dgx-h100x64").inter.beta == 1 / 50e9


@pytest.mark.skipif(sys.version_info < (3, 11), reason="TOML needs tomllib (Python >= 3.11)")
def test_a_toml_cluster_file_is_the_same_cluster_as_its_json(tmp_path):
    toml = tmp_path / "box.toml"
    toml.write_text("""name = "box"\nnodes = 2\nranks_per_node = 4\nsources = ["a test"]
[device]\ntflop_s = {float32 = 82.6}\nmemory_gb = 24\nmemory_gb_s = 1008
[links.intra]\nalpha_us = 10\nbandwidth_gb_s = 25
[links.inter]\nalpha_us = 30\nbandwidth_gb_s = 3.125\nranks_per_port = 4
""")
    c = load_cluster(toml)
    assert (c.size, c.inter.ranks_per_port, c.device.rate("float32")) == (8, 4, 82.6e12)
    assert math.isclose(c.intra.beta, 1 / 25e9) and c.link(0, 5) == c.inter


@pytest.mark.parametrize("change,words", [
    ({"nodes": 0}, "nodes is 0"),
    ({"device": {"tflop_s": 1, "memory_gb": 8}}, "device.memory_gb_s is missing"),
    ({"links": {"intra": {"alpha_us": 1, "bandwidth_gb_s": 1, "speed": 3}}}, "unknown key 'speed'"),
    ({"nodes": 2}, "links.inter is missing"),
    ({"stragglers": [{"rank": 1, "compute": 0.5}]}, "slowdowns >= 1"),
])
def test_a_bad_cluster_says_which_field(change, words):
    good = {"name": "x", "nodes": 1, "ranks_per_node": 2, "device": {"tflop_s": 1, "memory_gb": 8,
            "memory_gb_s": 100}, "links": {"intra": {"alpha_us": 1, "bandwidth_gb_s": 10}}}
    with pytest.raises(ConfigError, match=words):
        cluster_from_dict(good | change)
