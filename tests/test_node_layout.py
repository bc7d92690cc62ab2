"""The node layout: which ranks share a host, from each launcher, and what hierarchical and auto
make of it.

Launchers by their environment (torchrun, Slurm), MPI's shared-memory split in a real mpiexec on
this one host, dplab's own launch; ``layout.resolve`` (hierarchical's g from the hosts, a g that
contradicts them refused in one line); auto's candidates and two-level pricing on several hosts.
Across real (namespace) hosts: ``tests/test_hosts_layout.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from dplab.backends import allreduce, launch
from dplab.backends.cli.args import build_parser
from dplab.backends.cli.checks import check_args
from dplab.backends.launch.engine import launcher_hosts, local_ranks
from dplab.reference import auto
from dplab.reference.algorithms import allreduce_schedule
from dplab.reference.algorithms.layout import describe, node_size, resolve
from dplab.reference.communicator import Communicator
from dplab.reference.costfit import CostFit
from dplab.reference.costmodel import cost
from dplab.reference.errors import ConfigError
from dplab.reference.topology import Link, Topology
from dplab.reference.train.buckets import Reducer
from dplab.reference.train.sync import SyncConfig

TWO_BY_TWO = (0, 0, 1, 1)
REFUSED = ("hierarchical:3 puts 3 ranks in a node, but the launcher put 2 hosts of 2 ranks: use "
           "--algorithm hierarchical (g from the hosts) or hierarchical:2")
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
# task 3 of `srun -N 2 -n 4` (as tests/test_slurm.py's, a real Slurm 22.05's keys)
SRUN = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


# -- the launchers ---------------------------------------------------------------------------------

def test_torchrun_layout_from_local_world_size_and_group_rank():
    assert launcher_hosts(4, TORCHRUN) == TWO_BY_TWO
    six = TORCHRUN | {"WORLD_SIZE": "6", "RANK": "5", "GROUP_RANK": "2"}
    assert launcher_hosts(6, six) == (0, 0, 1, 1, 2, 2)
    assert launcher_hosts(4, TORCHRUN | {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}) == (
        0,
        0,
        0,
        0,
    )
    # what the environment cannot tell every rank: hosts of other sizes (the communicator gathers)
    assert launcher_hosts(5, TORCHRUN | {"WORLD_SIZE": "5"}) is None
    # rank 3 is not on group 0 of 2 each
    assert launcher_hosts(4, TORCHRUN | {"GROUP_RANK": "0"}) is None
    assert launcher_hosts(2, TORCHRUN) is None  # a world other than the launcher's
    assert local_ranks("torch", TORCHRUN) == (2, 4)


def test_slurm_layout_from_tasks_per_node_with_block_placement():
    assert launcher_hosts(4, SRUN) == TWO_BY_TWO
    uneven = SRUN | {"SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "3,2"}
    assert launcher_hosts(5, uneven) == (0, 0, 0, 1, 1)
    assert launcher_hosts(4, SRUN | {"SLURM_DISTRIBUTION": "block:cyclic"}) == TWO_BY_TWO
    # rank r on node r mod 2
    assert launcher_hosts(4, SRUN | {"SLURM_DISTRIBUTION": "cyclic"}) is None
    assert local_ranks("mpi", SRUN) == (2, 4) and local_ranks("torch", SRUN) == (2, 4)
    assert launcher_hosts(4, {}) is None and local_ranks("mpi", {}) is None


def test_torch_hosts_the_environment_cannot_tell_are_gathered(monkeypatch):
    """torchrun with 3 ranks on one host and 2 on the other: each rank's GROUP_RANK, gathered."""
    from types import SimpleNamespace

    from dplab.backends.launch.engine import torch_hosts

    for k, v in (
        TORCHRUN | {"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0"}
    ).items():
        monkeypatch.setenv(k, v)
    # as rank 0
    comm = SimpleNamespace(world_size=5, allgather_object=lambda mine: [mine] * 3 + ["1"] * 2)
    assert torch_hosts(comm) == (0, 0, 0, 1, 1)
    # 2 hosts of 3: the environment says it, nothing is gathered
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("GROUP_RANK", "1")  # rank 3 is the second host's first
    assert torch_hosts(SimpleNamespace(world_size=6)) == (0, 0, 0, 1, 1, 1)


def test_hydra_local_counts():
    assert local_ranks("mpi", {"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}) == (2, 4)


def _hosts(comm):
    return comm.hosts


@pytest.mark.parametrize("backend", ["local", "mpi", "torch"])
def test_dplab_launch_and_mpi_split_on_one_host_are_one_host(backend):
    """dplab's own launch: one host. On mpi the layout is MPI's shared-memory split (under a real
    mpiexec on this machine): all of them too."""
    if backend != "local":
        from dplab.backends.launch.world import BackendUnavailable, check_backend
        try:
            check_backend(backend)
        except BackendUnavailable as e:
            pytest.skip(str(e))
    assert launch(_hosts, 3, backend=backend) == [(0, 0, 0)] * 3


def test_hosts_are_renumbered_in_rank_order_and_checked():
    class Stub(Communicator):
        rank, world_size = 0, 4
        isend = irecv = native_allreduce = close = None  # type: ignore[assignment]

    c = Stub()
    assert c.hosts == (0, 0, 0, 0)
    c.hosts = (7, 7, 3, 3)  # e.g. each host's first rank, or a node id
    assert c.hosts == TWO_BY_TWO
    with pytest.raises(ConfigError, match="names 3 ranks' hosts, the world has 4"):
        c.hosts = (0, 0, 1)


# -- hierarchical ---------------------------------------------------------------------------------

def test_node_size():
    assert node_size((0, 0, 0)) == 3 and node_size(TWO_BY_TWO) == 2 and node_size((0, 0, 1)) == 2
    assert node_size((0, 1, 0, 1)) is None and node_size((0, 1, 1)) is None
    assert node_size((0, 0, 1, 1, 1)) is None
    assert (
        describe(TWO_BY_TWO) == "2 hosts of 2 ranks"
        and describe((0, 0, 1)) == "2 hosts of 2, 1 ranks"
    )


def test_resolve_takes_g_from_several_hosts_and_refuses_another():
    assert resolve("hierarchical", TWO_BY_TWO) == "hierarchical:2"
    assert resolve("hierarchical:2", TWO_BY_TWO) == "hierarchical:2"
    assert resolve("hierarchical", (0, 0, 0, 1, 1, 1)) == "hierarchical:3"
    assert resolve("hierarchical", (0, 0, 0, 1, 1)) == "hierarchical:3"  # a smaller last host
    with pytest.raises(ConfigError) as e:
        resolve("hierarchical:3", TWO_BY_TWO)
    assert str(e.value) == REFUSED
    with pytest.raises(
        ConfigError, match=r"needs consecutive ranks on each host .* \[0, 1, 0, 1\]"
    ):
        resolve("hierarchical", (0, 1, 0, 1))
    # one host: no real nodes, so the schedule's simulated ones stand (the registry default, any g)
    assert resolve("hierarchical", (0, 0, 0, 0)) == "hierarchical"
    assert resolve("hierarchical:3", ()) == "hierarchical:3"
    assert resolve("ring", TWO_BY_TWO) == "ring" and resolve("auto", (0, 1, 0, 1)) == "auto"


def test_sync_config_and_the_command_line_refuse_a_g_that_is_not_the_hosts(monkeypatch):
    SyncConfig("hierarchical").validate(4, TWO_BY_TWO)
    with pytest.raises(ConfigError, match="puts 3 ranks in a node"):
        SyncConfig("hierarchical:3").validate(4, TWO_BY_TWO)
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    train = ["train", "--backend", "torch", "--algorithm"]
    check_args(build_parser().parse_args([*train, "hierarchical"]), False)
    with pytest.raises(ConfigError) as e:
        check_args(build_parser().parse_args([*train, "hierarchical:3"]), False)
    assert str(e.value) == REFUSED
    with pytest.raises(ConfigError, match="puts 1 ranks in a node"):
        check_args(
            build_parser().parse_args(
                [
                    "compare",
                    "--backends",
                    "torch",
                    "--world-sizes",
                    "4",
                    "--algorithms",
                    "ring,hierarchical:1",
                ]
            ),
            False,
        )


def _on_two_hosts(comm, name):
    """Pretend the launcher put ranks {0, 1} and {2, 3} on two hosts (the data path is
    unchanged)."""
    comm.hosts = TWO_BY_TWO
    comm.tracer.enabled = True
    x = np.arange(10.0) + comm.rank
    try:
        allreduce(comm, x, name)
    except ConfigError as e:
        return str(e)
    reducer = Reducer(comm, x, [slice(0, 10)], algorithm=name)
    try:
        ran = [e.algorithm for e in comm.tracer.take() if e.kind == "allreduce"]
        return ran, reducer.algorithm_for(x), float(np.abs(x - (4 * np.arange(10) + 6)).max())
    finally:
        reducer.close()


def test_the_engine_and_the_reducer_resolve_on_the_communicators_hosts():
    assert launch(_on_two_hosts, 4, backend="local", args=("hierarchical",)) == [
        (["hierarchical:2"], "hierarchical:2", 0.0)] * 4
    assert launch(_on_two_hosts, 4, backend="local", args=("hierarchical:3",)) == [REFUSED] * 4


# -- auto ------------------------------------------------------------------------------------------

def _tuning(links=()):
    fits = (CostFit("mpi", "all", "all", 20e-6, 0.0, 1e-9),
            CostFit("mpi", "all", "native", 10e-6, 1e-9, None))
    return auto.Tuning(fits, "test", (), links)


def test_auto_on_several_hosts_offers_hierarchical_with_the_real_g():
    t = _tuning()
    assert "hierarchical" in t.candidates("mpi") and "hierarchical:2" not in t.candidates("mpi")
    several = t.candidates("mpi", auto.node_key(TWO_BY_TWO))
    assert "hierarchical:2" in several and "hierarchical" not in several and several[-1] == "native"
    assert not any(
        a.startswith("hierarchical") for a in t.candidates("mpi", auto.node_key((0, 1, 0, 1)))
    )
    assert auto.node_key((0, 0, 0, 0)) == auto.ONE_HOST and auto.node_key(None) == auto.ONE_HOST
    assert auto.node_key((0, 1, 0, 1)) == auto.SCATTERED and auto.node_key((0, 0, 0, 1, 1, 1)) == 3


def test_auto_prices_two_level_where_the_tune_file_has_both_links(tmp_path):
    # fast inside a host, a slow link between: hierarchical crosses it with a g-th of the bytes
    links = (("mpi", "intra", 2e-6, 1 / 10e9, 0.0), ("mpi", "inter", 20e-6, 1 / 0.125e9, 1e-10))
    t = auto.Tuning.from_json(_tuning(links).to_json(), "round trip")
    assert t.links == links
    topo = t.topology("mpi", 2)
    assert topo == Topology(
        "mpi-tuned", 2, Link(2e-6, 1e-10), Link(20e-6, 8e-9), 1e-10, topo.source
    )
    n = 16 << 20
    priced = {a: cost(allreduce_schedule(a, 4), n, itemsize=4, topology=topo).time
              for a in t.candidates("mpi", 2) if a != "native"}
    best = min(priced, key=priced.get)
    assert best == "hierarchical:2" and priced["hierarchical:2"] < 0.5 * priced["ring"]
    assert t.choose("mpi", 4, n, 4, 2) == best
    assert t.choose("mpi", 4, n, 4) == _tuning().choose("mpi", 4, n, 4)  # one host: links unused
    bad = _tuning(links).to_json()
    bad["links"][0]["level"] = "rack"
    with pytest.raises(ConfigError, match=r"links\[0\].level is 'rack', not 'intra' or 'inter'"):
        auto.Tuning.from_json(bad, "tune.json")
