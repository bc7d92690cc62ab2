"""dplab under Slurm, at three depths.

1. Slurm's documented variables (srun(1), OUTPUT ENVIRONMENT VARIABLES) read by ``engine``: node
   lists, tasks per node, which task is which rank, torch's env:// variables made from them.
2. Ranks started by hand with the variables ``srun`` sets (no Slurm needed): ``dplab train
   --backend torch`` lands on the single-device parameters; ``--backend mpi`` without a PMI is
   refused in one line instead of training four worlds of one.
3. A real Slurm (Debian's slurmctld, slurmd and munge; root): two nodes, each a namespace host
   (``netns.Cluster``) named by its address, one slurmd in each, and the shipped sbatch example
   run there: ``srun --mpi=pmi2 dplab train --backend mpi``, ``srun dplab train --backend torch``
   and srun + torchrun train equal to one device with the bytes crossing the link. Skipped, with
   the reason, where Slurm's daemons are not installed or namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hosts
import numpy as np
import pytest

from dplab.backends.cli.args import build_parser
from dplab.backends.cli.commands import _train_config
from dplab.backends.hosts.netns import MPI_ENV, TORCH_ENV, Cluster
from dplab.backends.launch import engine
from dplab.backends.launch.engine import (
    SlurmStep,
    expand_nodelist,
    slurm_step,
    slurm_torch_env,
    tasks_per_node,
)
from dplab.reference.errors import ConfigError
from dplab.reference.train.single import train_single

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "backends" / "launch" / "slurm_example.sbatch"
TRAIN = ["train", "--steps", "4", "--hidden", "16", "--num-samples", "256", "--global-batch", "32"]
REL = 1e-10

# What srun gives task 3 of `srun -N 2 -n 4` inside an allocation of 4 nodes x 2 tasks (job 42),
# as a real Slurm 22.05 does (test 3 prints the same keys).
SRUN_TASK3 = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
              "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
              "SLURM_JOB_NODELIST": "node[07-10]", "SLURM_NODELIST": "node[07-10]",
              "SLURM_TASKS_PER_NODE": "2(x4)"}
# The batch script of `sbatch -n 2` has the job's task count and procid 0, but it is no rank.
BATCH = {"SLURM_JOB_ID": "43", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
         "SLURM_NODELIST": "node07", "SLURM_TASKS_PER_NODE": "2"}


# -- 1. the variables ------------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist, hosts_", [
    ("node[01-03,07],login1", ["node01", "node02", "node03", "node07", "login1"]),
    ("h[0-1]", ["h0", "h1"]),
    ("10.213.0.[1-2]", ["10.213.0.1", "10.213.0.2"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("single", ["single"]),
    ("", []),
])
def test_expand_nodelist(nodelist, hosts_):
    assert expand_nodelist(nodelist) == hosts_


def test_bad_lists_are_one_line():
    with pytest.raises(ConfigError, match="not a number or a range"):
        expand_nodelist("node[a-c]")
    with pytest.raises(ConfigError, match=r"not N or N\(xK\)"):
        tasks_per_node("2(x")
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]


def test_srun_task_is_a_rank_of_its_step():
    step = slurm_step(SRUN_TASK3)
    assert step == SlurmStep(rank=3, world_size=4, local_rank=1, local_world_size=2,
                             nodes=("node07", "node08"), job_id=42, step_id=0)


@pytest.mark.parametrize("env", [BATCH, {}, SRUN_TASK3 | {"SLURM_STEP_NUM_TASKS": "1"}],
                         ids=["batch-script", "no-slurm", "one-task"])
def test_not_a_step_of_several_tasks(env):
    assert slurm_step(env) is None


def test_torch_env_from_the_step():
    env = slurm_torch_env(slurm_step(SRUN_TASK3), {})
    assert {
        k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node07",
    }
    rank0 = slurm_torch_env(slurm_step(SRUN_TASK3 | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                                                      "SLURM_NODEID": "0"}), {})
    next_step = slurm_torch_env(slurm_step(SRUN_TASK3 | {"SLURM_STEP_ID": "1"}), {})
    assert rank0["MASTER_PORT"] == env["MASTER_PORT"] != next_step["MASTER_PORT"]
    assert 1024 < int(env["MASTER_PORT"]) < 65536
    mine = slurm_torch_env(
        slurm_step(SRUN_TASK3), {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "1234"}
    )
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.7", "1234")  # the user's win


def _only(monkeypatch, env):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL")) or k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "DPLAB_AUTHKEY",
        ):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_engine_sees_the_step(monkeypatch):
    _only(monkeypatch, SRUN_TASK3)
    assert engine.under_launcher("torch") and engine.launcher_env("torch") == (3, 4)
    assert engine.launcher_rank() == 3
    assert engine.spans_hosts() == "this srun step has 4 ranks, 2 of them on this host"
    assert engine.under_launcher("mpi")  # a job of 4 tasks: never start 4 worlds of our own
    with pytest.raises(ConfigError, match=r"^srun started 4 tasks but gave MPI no PMI.*srun "
                                          r"--mpi=pmi2"):
        engine.launcher_env("mpi")
    _only(monkeypatch, SRUN_TASK3 | {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "9"})  # --mpi=pmi2
    assert engine.launcher_env("mpi") == (3, 4)
    # --mpi=pmix
    _only(monkeypatch, SRUN_TASK3 | {"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.7.0"})
    assert engine.launcher_env("mpi") == (3, 4) and engine.launcher_rank() == 3
    _only(monkeypatch, SRUN_TASK3 | {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                                     "MASTER_ADDR": "node07", "MASTER_PORT": "29500"})
    # torchrun's worker, not SLURM_PROCID 3
    assert engine.launcher_env("torch") == (0, 8) and engine.launcher_rank() == 0
    assert not engine.under_launcher("mpi")  # srun's task was torchrun, not this process
    assert engine.spans_hosts() == "this torchrun job has 8 ranks, 4 of them on this host"
    _only(monkeypatch, BATCH)
    assert not engine.under_launcher("torch") and not engine.under_launcher("mpi")
    assert engine.launcher_rank() is None and engine.spans_hosts() is None


# -- 2. ranks with srun's variables, started by hand -----------------------------------------------

def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in hosts.hosts_env({}).items() if not k.startswith("SLURM_")}
    return env | extra


def _srun_env(rank: int, world: int, job: int) -> dict[str, str]:
    """What srun sets for task ``rank`` of ``srun -n world`` on one node called localhost."""
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": str(world),
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": str(world), "SLURM_NODELIST": "localhost"}


def _by_hand(args: list[str], world: int, cwd: Path, job: int) -> list[tuple[int, str, str]]:
    procs = [
        subprocess.Popen(
            [hosts.DPLAB, *args],
            cwd=cwd,
            env=_clean_env(_srun_env(r, world, job)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    return hosts.finish(procs)


def _check_train(path: Path, backend: str, world: int) -> None:
    """The row: ``world`` identical replicas at the single-device parameters (float64, 1e-10)."""
    row = json.loads(path.read_text())["rows"][0]
    ref = train_single(_train_config(build_parser().parse_args(TRAIN), None)).params
    scale = max(1.0, float(np.max(np.abs(ref))))
    assert (row["backend"], row["world_size"], row["ranks_identical"]) == (backend, world, True), (
        row
    )
    assert row["max_abs_diff_vs_single"] <= REL * scale, row


@pytest.mark.torch
@pytest.mark.slow  # slow: 2 fresh interpreters import torch, train (5 CPU-s); the env: above
def test_srun_variables_start_torch_ranks(tmp_path):
    hosts._needs("torch")
    done = _by_hand([*TRAIN, "--backend", "torch", "--json", "rows.json"], 2, tmp_path,
                    job=os.getpid() % 10000)
    assert [code for code, _, _ in done] == [0, 0], done[0][2][-2000:]
    assert done[1][1] == ""  # only rank 0 prints
    _check_train(tmp_path / "rows.json", "torch", 2)


@pytest.mark.mpi
def test_srun_without_pmi_is_one_line(tmp_path):
    hosts._needs("mpi")
    done = _by_hand(["train", "--backend", "mpi"], 2, tmp_path, job=1)
    assert [code for code, _, _ in done] == [2, 2]
    lines = [line for _, _, err in done for line in err.splitlines() if line]
    assert lines == ["dplab train: error: srun started 2 tasks but gave MPI no PMI, so each would "
                     "be a world of one: run srun --mpi=pmi2 (or --mpi=pmix; srun --mpi=list shows "
                     "what this Slurm has)"]


# -- 3. a real Slurm over two namespace hosts ------------------------------------------------------

DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "nsenter")


class Slurm:
    """slurmctld on node 0, a slurmd on each node (named by its address, so every node name
    resolves), munged for both; all state in one folder. ``srun``/``sbatch`` run on node 0."""

    def __init__(self, c: Cluster, folder: Path) -> None:
        self.c, self.dir = c, folder
        self.conf = folder / "slurm.conf"
        self._procs: list[subprocess.Popen] = []

    def start(self) -> None:
        d = self.dir
        d.chmod(0o755)  # munged wants its socket's folder searchable by all
        for name in ["state", *(f"spool/{a}" for a in self.c.addrs)]:
            (d / name).mkdir(parents=True)
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o600)
        self._procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={d}/munge.sock",
                    f"--key-file={d}/munge.key",
                    f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munge.seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        nodes = "\n".join(f"NodeName={a} CPUs=2 State=UNKNOWN" for a in self.c.addrs)
        self.conf.write_text(f"""ClusterName=dplabtest
SlurmctldHost={socket.gethostname()}({self.c.addrs[0]})
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup tree slurmd
        # needs
        self._daemon(0, ["slurmctld", "-D", "-i"])
        for i, addr in enumerate(self.c.addrs):
            self._daemon(i, ["slurmd", "-D", "-N", addr])
        deadline = time.monotonic() + 30
        while (
            self.run(["sinfo", "-h", "-o", "%T %D"], {}, 10).stdout.strip()
            != f"idle {self.c.hosts}"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("Slurm did not come up: "
                                   f"{(d / 'slurmctld.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def _daemon(self, host: int, argv: list[str]) -> None:
        self._procs.append(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.c.namespaces[host]}", *argv], env=self.env({}),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        return _clean_env({"SLURM_CONF": str(self.conf)} | extra)

    def run(self, argv: list[str], extra: dict[str, str], timeout: float,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return self.c.run(0, argv, timeout, env=self.env(extra), cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        for p in reversed(self._procs):  # slurmds, slurmctld, then munged
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    hosts.needs_hosts()
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"real Slurm: {', '.join(missing)} not installed (Debian: slurmctld slurmd "
                    "munge)")
    hosts._needs("mpi")
    hosts._needs("torch")
    with Cluster(hosts=2, ranks_per_host=2) as c:
        s = Slurm(c, tmp_path_factory.mktemp("slurm"))
        try:
            s.start()
            yield s
        finally:
            s.stop()


def _link_bytes(c: Cluster) -> int:
    return int(Path(f"/sys/class/net/{c.veths[1]}/statistics/rx_bytes").read_text())


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.hosts
@pytest.mark.mpi
@pytest.mark.torch
def test_sbatch_example_runs_all_three(slurm, tmp_path):
    """The shipped example on 2 nodes x 2 tasks: ``srun --mpi=pmi2 dplab train --backend mpi``,
    ``srun dplab train --backend torch`` (MASTER_ADDR from the node list: nothing set by hand) and
    srun + torchrun each print one row of 4 identical replicas at the single-device parameters."""
    # dplab and torchrun on the PATH, as the example asks
    bin_dir = str(Path(sys.executable).parent)
    extra = MPI_ENV | TORCH_ENV | {"PATH": f"{bin_dir}:{os.environ['PATH']}",
                                   "DPLAB_ARGS": " ".join(TRAIN[1:])}
    before = _link_bytes(slurm.c)
    _ok(
        slurm.run(
            ["sbatch", "-W", "-o", str(tmp_path / "out.txt"), str(EXAMPLE)], extra, 150, tmp_path
        )
    )
    # each run's gradients crossed between the nodes
    assert _link_bytes(slurm.c) - before > 3 * 20_000
    out = (tmp_path / "out.txt").read_text()
    rows = [line.split() for line in out.splitlines() if " sync " in line]
    assert [(r[0], r[3], r[7]) for r in rows] == [("mpi", "4", "True"), ("torch", "4", "True"),
                                                  ("torch", "4", "True")], out[-3000:]
    ref = train_single(_train_config(build_parser().parse_args(TRAIN), None)).params
    assert all(float(r[6]) <= REL * max(1.0, float(np.max(np.abs(ref)))) for r in rows), out
