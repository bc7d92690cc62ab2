"""NVLS priced from the cluster file, timing-only runs of any schedule, and lesson 2's GPU steps.

    pytest -q tests/test_nvls.py
"""

from __future__ import annotations

import json

import pytest

from dplab.backends.sim.timing import collective_time, schedule_time
from dplab.lessons import lesson
from dplab.lessons.l02_allreduce import rings_per_nic
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.cluster import PRESET_DIR, cluster, cluster_from_dict
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError
from dplab.reference.nvls import nvls_time
from dplab.reference.simulate import is_allreduce, simulate
from dplab.reference.topology import Topology

MIB = 1 << 20


def test_one_node_nvls_is_two_latencies_and_each_byte_about_once():
    c = cluster("dgx-h100")
    n, p = 256 * MIB, 8
    assert nvls_time(c, p, n) == pytest.approx(2 * c.intra.alpha + (1 + 1 / p) * n * c.intra.beta)
    ring = collective_time(c, p, "ring", n).seconds
    assert nvls_time(c, p, n) < ring / 1.5  # about half the ring's bytes, no reductions on the GPU


def test_across_nodes_nvls_adds_a_double_tree_of_an_eighth_between_the_nodes():
    c = cluster("dgx-h100x4")
    n = 64 * MIB
    between = Topology.flat(c.inter.alpha, c.inter.beta, c.gamma)
    tree = cost(allreduce_schedule("double_tree", 4), n // 8, itemsize=4, topology=between).time
    assert nvls_time(c, 32, n) == pytest.approx(2 * (c.intra.alpha + n * c.intra.beta) + tree)


def test_a_cluster_whose_switch_does_not_add_has_no_nvls():
    with pytest.raises(ConfigError, match="no switch that adds"):
        nvls_time("h100-100g", 8, MIB)
    with pytest.raises(ConfigError, match="holds 8 ranks"):
        nvls_time("dgx-h100", 16, MIB)


def test_switch_reduces_is_read_from_the_file_and_checked():
    data = json.loads((PRESET_DIR / "dgx-h100.json").read_text())
    assert cluster_from_dict(data).intra.switch_reduces
    assert not cluster_from_dict(data).inter.switch_reduces
    data["links"]["intra"]["switch_reduces"] = "yes"
    with pytest.raises(ConfigError, match="switch_reduces is 'yes': it must be true or false"):
        cluster_from_dict(data)


def test_schedule_time_of_a_named_schedule_is_collective_time():
    for alg in ("ring", "double_tree"):
        a = schedule_time("dgx-h100x2", allreduce_schedule(alg, 16), 8 * MIB).seconds
        assert a == collective_time("dgx-h100x2", 16, alg, 8 * MIB).seconds


def test_channels_are_all_reduces_and_each_adds_a_nic():
    times = {}
    for k in (1, 2, 8):
        schedule = rings_per_nic(16, 8, k)
        assert is_allreduce(simulate(schedule))
        times[k] = schedule_time("dgx-h100x2", schedule, 64 * MIB).seconds
    assert times[1] > 1.8 * times[2] and times[2] > 1.8 * times[8]  # 8 NICs, NVLink shows
    assert rings_per_nic(16, 8).rounds == rings_per_nic(16, 8, 8).rounds  # step 7's, unchanged


def test_lesson_2_gpu_questions_name_their_mistakes():
    steps = lesson(2).steps
    bus = next(s for s in steps if s.title.startswith("busbw"))
    assert bus.asks_before_run()  # lessons 1-4 ask before they run
    facts = {"p": 8, "factor": 1.75}
    assert bus.predict.judge(facts, "1.75").correct and bus.predict.judge(facts, "7/4").correct
    assert "only at p = 2" in bus.predict.judge(facts, "1").message
    assert "where 2(p-1)/p tends" in bus.predict.judge(facts, "2").message
    assert "one rank's" in bus.predict.judge(facts, "8").message
    assert "the reduce-scatter" in bus.predict.judge(facts, "0.875").message
    channels = next(s for s in steps if s.title.startswith("Channels"))
    assert channels.asks_before_run()
    facts = {"p": 16, "one": 48.0, "cluster": "dgx-h100x2"}
    assert channels.predict.judge(facts, "50").correct
    assert "one of them" in channels.predict.judge(facts, "400").message
    assert "NVLink is not the bottleneck" in channels.predict.judge(facts, "450").message
    scale = next(s for s in steps if s.title.startswith("Ring, tree and NVLS"))
    assert scale.asks_before_run()
    assert "2,046" in scale.predict.judge({"fastest_1024": "nvls"}, "ring").message
