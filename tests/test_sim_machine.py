"""What the this-machine model adds to the simulator, each on a small cluster of its own: cores as
a pool (p ranks on fewer cores take p / cores times as long while all of them work, and run at
full speed while the others wait), a transport's per-algorithm terms (dplab tune's fit of each
algorithm alone, gamma folded in), and the parameter server's update on its clock."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_collective_whose_buffers_fill_the_cache_moves_its_bytes_at_the_memorys_rate():
    n, alpha, gamma = 4 * MIB, 10e-6, 1 / 4e9
    doc = _cores(True)
    doc["links"]["intra"] |= {"cache_mib": 16, "past_cache_gb_s": 0.5}
    c = cluster_from_dict(doc)
    link = c.intra
    assert link.cache_bytes == 16 * MIB and link.past_cache_beta == pytest.approx(1 / 0.5e9)
    assert link.beta_at(16 * MIB - 1) == link.beta and link.beta_at(16 * MIB) == 2e-9
    # ring on 2 ranks: two messages of n / 2 each way, gamma on the half each rank reduces; the
    # node holds 2 buffers of n: within the cache at 4 MiB, past it at 8 MiB (2 x 8 = 16 MiB)
    ring = lambda n, beta: 2 * (alpha + n / 2 * beta) + n / 2 * gamma  # noqa: E731
    assert collective_time(c, 2, "ring", n).seconds == pytest.approx(ring(n, 1 / 2e9))
    assert collective_time(c, 2, "ring", 2 * n).seconds == pytest.approx(ring(2 * n, 2e-9))
    # 4 ranks of 4 MiB fill it too; the same schedule with real data costs the same
    assert collective_time(c, 4, "ring", n).seconds == pytest.approx(
        launch(_ring, 4, backend="sim", cluster=c, args=(n,))[0])
    assert launch(_ring, 2, backend="sim", cluster=c, args=(2 * n,))[0] == pytest.approx(
        ring(2 * n, 2e-9))
    # a straggler's link is slower past the cache too
    assert link.slowed(2).past_cache_beta == pytest.approx(4e-9)


def _ring(comm, nbytes):
    import numpy as np

    from dplab.backends.fastpath.executor import allreduce

    buf = np.ones(nbytes // 4, np.float32)
    t0 = comm.now()
    allreduce(comm, buf, "ring")
    return comm.now() - t0


def test_a_cache_without_its_rate_past_it_says_which_is_missing():
    from dplab.reference.errors import ConfigError

    doc = _cores(True)
    doc["links"]["intra"]["cache_mib"] = 32
    with pytest.raises(ConfigError, match=r"links.intra.past_cache_gb_s is missing"):
        cluster_from_dict(doc, "c")
    doc["links"]["intra"] |= {"cache_mib": -1, "past_cache_gb_s": 5}
    with pytest.raises(ConfigError, match=r"links.intra.cache_mib is -1"):
        cluster_from_dict(doc, "c")
    doc["links"]["intra"] |= {"cache_mib": 32, "crowded_alpha_us": {"ring": -3}}
    with pytest.raises(ConfigError, match=r"links.intra.crowded_alpha_us.ring is -3"):
        cluster_from_dict(doc, "c")


def test_the_calibration_runs_a_measurement_on_every_core_at_once(tmp_path):
    import os

    from dplab.backends.sim import machine

    def pid(ready):
        ready()  # every process set up before any goes on: they run at once
        return os.getpid()

    pids = machine._together(pid, 2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert machine._mid([3.0, 1.0, 2.0]) == 2.0 and machine._mid([1.0, 2.0]) == 2.0
    assert machine._cache_bytes() > 0 and machine._cache_bytes(2) > 0


def test_an_algorithm_pays_its_crowded_alpha_once_ranks_outnumber_the_cores():
    doc = _cores(True, {"tree": {"alpha_us": 3, "bandwidth_gb_s": 5}})
    doc["links"]["intra"]["crowded_alpha_us"] = {"ring": 50, "tree": 30}
    c, plain = cluster_from_dict(doc), cluster_from_dict(_cores(True, {"tree": {
        "alpha_us": 3, "bandwidth_gb_s": 5}}))
    assert c.intra.for_algorithm("ring", crowded=True).alpha == pytest.approx(50e-6)
    tree = c.intra.for_algorithm("tree", crowded=True)
    assert (tree.alpha, tree.beta) == (pytest.approx(30e-6), pytest.approx(1 / 5e9))
    assert c.intra.for_algorithm("direct", crowded=True).alpha == pytest.approx(10e-6)
    # 2 ranks on 2 cores: as without; 4 on 2: every message dearer, with real data as timing only
    for alg in ("ring", "tree"):
        two, four = (collective_time(c, p, alg, MIB).seconds for p in (2, 4))
        assert two == collective_time(plain, 2, alg, MIB).seconds
        assert four > collective_time(plain, 4, alg, MIB).seconds
    assert collective_time(c, 4, "ring", MIB).seconds == pytest.approx(
        launch(_ring, 4, backend="sim", cluster=c, args=(MIB,))[0])
    assert c.intra.slowed(2).crowded == (("ring", pytest.approx(100e-6)),
                                         ("tree", pytest.approx(60e-6)))


def test_the_crowded_alpha_is_the_one_at_which_the_simulator_gives_the_measured_time(monkeypatch):
    from dplab.backends.sim import machine

    doc = _cores(True)
    truth = json.loads(json.dumps(doc))
    truth["links"]["intra"]["crowded_alpha_us"] = {"ring": 42, "native": 7}
    made = cluster_from_dict(truth)
    rows = [{"algorithm": a, "world_size": 4, "bytes": n,
             "time_us": collective_time(made, 4, a, n).seconds * 1e6}
            for a in ("ring", "native") for n in (65536, 262144)]
    rows.append({"algorithm": "memcpy", "world_size": 4, "bytes": 65536, "time_us": 1.0})
    monkeypatch.setattr(machine, "_bench", lambda ranks, sizes: rows)
    alphas, measured = machine._crowded(doc, 4)
    assert alphas == {"ring": pytest.approx(42e-6, rel=1e-6), "native": pytest.approx(7e-6,
                                                                                     rel=1e-6)}
    assert sorted(measured) == ["native", "ring"] and len(measured["ring"]) == 2


def test_the_rate_past_the_cache_is_the_transports_at_which_the_simulator_gives_the_measured_time(
        monkeypatch):
    from dplab.backends.sim import machine

    doc = _cores(True)
    doc["links"]["intra"] |= {"cache_mib": 16, "past_cache_gb_s": 5}  # a plain copy's rate
    truth = json.loads(json.dumps(doc))
    truth["links"]["intra"]["past_cache_gb_s"] = 0.8  # the transport's, slower
    made = cluster_from_dict(truth)
    asked = []

    def bench(ranks, sizes):
        asked.append(sizes)
        return [{"algorithm": a, "world_size": 2, "bytes": n,
                 "time_us": collective_time(made, 2, a, n).seconds * 1e6}
                for a in ("ring", "tree") for n in (16 * MIB, 64 * MIB)]

    monkeypatch.setattr(machine, "_bench", bench)
    rate, each, measured = machine._past_cache(doc)
    assert rate == pytest.approx(0.8e9, rel=1e-6)
    assert each == {"ring": pytest.approx(0.8e9, rel=1e-6), "tree": pytest.approx(0.8e9, rel=1e-6)}
    assert sorted(measured) == ["ring", "tree"] and len(measured["tree"]) == 2
    # measured as the validation rows are (measure_sim.sh), at sizes none of them has
    script = (Path(machine.__file__).parents[1] / "perf" / "measure_sim.sh").read_text()
    assert " ".join(machine.BENCH) in script
    validated = {"1M", "4M", "16M", "64M"}
    assert not validated & set(machine.SIZES)
    for sizes in (machine.PAST_SIZES, machine.CROWDED_SIZES):
        assert not validated & set(sizes.split(","))
    assert asked == [machine.PAST_SIZES]


def test_the_cache_ends_where_a_copys_rate_has_fallen_halfway_to_memorys():
    import numpy as np

    from dplab.backends.sim import machine

    # this machine's kernel: a 32 MiB L3, 512 KiB L2s, 2 cores: 2 to 128 MiB, steps of sqrt 2
    footprints = machine._footprints(32 * MIB, MIB // 2, 2)
    assert len(footprints) == 13 and footprints[0] == 2 * MIB and footprints[-1] == 128 * MIB
    assert np.allclose(np.diff(np.log2(footprints)), 0.5, atol=1e-3)

    def rates(middle, fast=30.0, slow=8.0, width=0.15):  # a fall centred at ``middle`` bytes
        x = np.log2(np.array(footprints) / middle) / width
        return list(slow + (fast - slow) / (1 + np.exp(x)))

    for middle in (5 * MIB, 13 * MIB, 20 * MIB):
        assert machine._fall(footprints, rates(middle)) == pytest.approx(middle, rel=0.05)
    noisy = rates(13 * MIB)
    noisy[1] = 12.0  # a cell in cache that something else slowed does not end the cache
    noisy[-1] = 5.0  # nor does one from memory that it slowed move the midpoint
    assert machine._fall(footprints, noisy) == pytest.approx(13 * MIB, rel=0.05)
    assert machine._fall(footprints, [8.0] * len(footprints)) == footprints[-1]  # no fall seen
    # every core copies its share at once, and a rate comes back for each footprint
    measured = machine._copy_rates(footprints[:2], 2, seconds=0.01)
    assert len(measured) == 2 and min(measured) > 0


def test_the_in_cache_fit_uses_sizes_within_half_the_cache_and_none_validated(monkeypatch):
    from dplab.backends.bench.timing import parse_size
    from dplab.backends.sim import machine

    assert machine._link_sizes(13 * MIB) == "64K,256K,2M,3M"
    for cache in (8 * MIB, 13 * MIB, 32 * MIB, 64 * MIB):  # two sizes for beta from 8 MiB
        sizes = machine._link_sizes(cache).split(",")
        assert len(sizes) == 4 and not {"1M", "4M", "16M", "64M"} & set(sizes)
        # by the simulator's rule: the 2 ranks' buffers, under the cache with a margin of 2
        link = cluster_from_dict(_cores(True) | {"links": {"intra": {
            "alpha_us": 1, "bandwidth_gb_s": 2, "cache_mib": machine.IN_CACHE * cache / MIB,
            "past_cache_gb_s": 1}}}).intra
        assert all(link.beta_at(2 * parse_size(s)) == link.beta for s in sizes)
    truth = cluster_from_dict(_cores(True))
    asked = []

    def bench(ranks, sizes):
        asked.append(sizes)
        return [{"backend": "local", "algorithm": a, "world_size": 2, "bytes": parse_size(n),
                 "time_us": collective_time(truth, 2, a, parse_size(n)).seconds * 1e6}
                for a in ("ring", "direct") for n in sizes.split(",")]

    monkeypatch.setattr(machine, "_bench", bench)
    alpha, beta, each = machine._link("64K,256K,2M,3M")
    assert asked == ["64K,256K,2M,3M"] and sorted(each) == ["direct", "ring"]
    assert alpha > 0 and beta > 0
    # a machine too busy to measure: times that do not grow with the bytes are refused in a line
    monkeypatch.setattr(machine, "_bench", lambda ranks, sizes: [
        {"backend": "local", "algorithm": a, "world_size": 2, "bytes": parse_size(n),
         "time_us": 900.0 - i} for a in ("ring", "direct")
        for i, n in enumerate(["64K", "256K", "2M", "3M"])])
    with pytest.raises(SystemExit, match="found no price per byte .* load below 1"):
        machine._link("64K,256K,2M,3M")


def test_the_compute_calibration_finds_the_flop_and_memory_rates_two_batches_need():
    from dplab.backends.sim import machine

    rate, memory = 20e9, 5e9  # what the machine does, to be found again
    layers = [(2048, 2048), (2048, 512)]

    def step(batch):  # a matmul per layer and an elementwise pass
        ops = [(2.0 * batch * i * o, 8.0 * (i * o + batch * (i + o))) for i, o in layers]
        ops += [(0.0, 8.0 * 3 * sum(i * o for i, o in layers))]  # the optimizer: bytes only
        return ops, machine._priced(ops, rate, memory, 1e-6)

    found = machine._rates(step(64), step(8), 1e-6)
    assert found == (pytest.approx(rate, rel=1e-6), pytest.approx(memory, rel=1e-6))


def test_the_calibrations_bench_is_a_dplab_bench_of_its_own(monkeypatch):
    """Run as the validated rows are: ranks forked from the calibrating process (torch loaded)
    measured 4 ranks on 2 cores up to twice as slow."""
    import subprocess

    from dplab.backends.sim import machine

    ran = []

    def run(argv, **kw):
        ran.append(argv)
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps({"meta": {}, "rows": [{"algorithm": "ring", "time_us": 5.0}]}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", run)
    assert machine._bench(4, "512K,2M") == [{"algorithm": "ring", "time_us": 5.0}]
    (argv,) = ran
    assert argv[:2] == [__import__("sys").executable, "-c"] and argv[3] == "bench"
    assert " ".join(machine.BENCH) in " ".join(argv) and "--world-sizes 4" in " ".join(argv)
