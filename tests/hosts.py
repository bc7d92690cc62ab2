"""Helpers for the multi-host tests: the ``cluster`` fixture and the engines' launchers across it.

    def test_x(cluster):                 # 2 hosts x 2 ranks, namespaces on a bridge (root only)
        procs = torchrun(cluster, ["train", "--backend", "torch"], rdzv_id="x")

Every test using ``cluster`` is marked ``hosts`` and skipped, with the reason, where namespaces
cannot be made (not root, no iproute2). The fixture takes the cluster down after the test,
passed or failed, and checks that nothing of it is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dplab.backends.hosts.netns import MPI_ENV, TORCH_ENV, Cluster, available, leftovers
from dplab.backends.launch.world import BackendUnavailable, check_backend

__all__ = ["cluster", "hosts_env", "torchrun", "mpiexec", "finish", "needs_hosts", "DPLAB", "REPO"]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DPLAB = str(BIN / "dplab")
LAUNCH_TIMEOUT_S = 90  # a hung launcher fails the test, not the suite's 300 s


def _needs(backend: str) -> None:
    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))


def needs_hosts() -> None:
    """Skip, with the reason, where network namespaces cannot be made."""
    why = available()
    if why is not None:
        pytest.skip(f"multi-host tests: {why}")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """2 hosts x 2 ranks; after the test, nothing of this process's clusters is left."""
    needs_hosts()
    with Cluster(hosts=2, ranks_per_host=2) as c:
        yield c
    assert leftovers(os.getpid()) == []


def hosts_env(extra: dict[str, str]) -> dict[str, str]:
    """This test's environment without any launcher it may run under, plus ``extra``."""
    drop = (
        "PMI_",
        "DPLAB_",
        "OMPI_",
        "PMIX_",
        "MPI_LOCAL",
        "TORCHELASTIC_",
        "GLOO_",
        "FI_",
        "UCX_",
        "MPIR_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    return env | {"OMP_NUM_THREADS": "1"} | extra


def torchrun(c: Cluster, dplab_args: list[str], rdzv_id: str, cwd: Path) -> list[subprocess.Popen]:
    """One ``torchrun -m dplab.backends.cli ...`` per host, each in its host's namespace."""
    _needs("torch")
    env = hosts_env(TORCH_ENV)
    return [c.popen(h, [sys.executable, "-m", "torch.distributed.run", *c.torchrun_args(h, rdzv_id),
                        "-m", "dplab.backends.cli", *dplab_args],
                    env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h in range(c.hosts)]


def mpiexec(c: Cluster, dplab_args: list[str], cwd: Path) -> list[subprocess.Popen]:
    """``mpiexec ... dplab ...`` from host 0, its proxies entering the other hosts' namespaces."""
    _needs("mpi")
    argv = [str(BIN / "mpiexec"), *c.mpiexec_args(), DPLAB, *dplab_args]
    return [c.popen(0, argv, env=hosts_env(MPI_ENV), cwd=cwd, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)]


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of every launcher, each given ``LAUNCH_TIMEOUT_S``."""
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(proc.args)} ran past {LAUNCH_TIMEOUT_S} s")
        done.append((proc.returncode, out, err))
    return done
