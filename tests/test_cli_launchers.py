"""Under mpiexec or torchrun, an error every rank hits is said once, by rank 0, with exit code 2.

Before, each rank printed it (torchrun) or printed a traceback and called MPI_Abort (mpiexec).
torchrun still adds its own ChildFailedError report and exits 1: that part is torchrun's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dplab.backends.launch.world import BackendUnavailable, check_backend

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    """This test's own environment, free of a launcher or world it may itself run under."""
    drop = ("PMI_", "DPLAB_", "OMPI_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _needs(backend: str) -> None:
    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.mpi
def test_mpiexec_world_size_mismatch_is_one_line_from_rank_0():
    _needs("mpi")
    proc = subprocess.run(
        [
            str(BIN / "mpiexec"),
            "-n",
            "3",
            str(BIN / "dplab"),
            "train",
            "--backend",
            "mpi",
            "--world-size",
            "4",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dplab train: error: the launcher started 3 ranks but --world-size is 4: drop --world-size "
        "or make them agree"], proc.stderr
    assert proc.stdout == ""


@pytest.mark.mpi
def test_mpiexec_bad_output_path_stops_the_whole_job(tmp_path):
    """Only rank 0 writes, so only rank 0 checks --json: it must not leave the others waiting in
    MPI_Init."""
    _needs("mpi")
    target = tmp_path / "missing" / "rows.json"
    proc = subprocess.run(
        [
            str(BIN / "mpiexec"),
            "-n",
            "2",
            str(BIN / "dplab"),
            "train",
            "--backend",
            "mpi",
            "--json",
            str(target),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dplab train: error: --json {target}: directory {target.parent} does not exist: create it "
        "first"]


@pytest.mark.torch
@pytest.mark.slow  # slow: a torchrun of two ranks importing torch (9 CPU-s) for one error's line
def test_torchrun_nccl_without_gpus_is_one_line_from_rank_0_exit_2():
    _needs("torch")
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs: NCCL would start")
    env = _env() | {"DPLAB_DEVICE": "cuda"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "dplab.backends.cli",
            "train",
            "--backend",
            "torch",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("dplab train")]
    have = torch.cuda.device_count()
    assert ours == [f"dplab train: error: 2 ranks need 2 GPUs, this machine has {have}: use "
                    "--device cpu (gloo), i.e. DPLAB_DEVICE=cpu"], proc.stderr
    assert "rank 0 failed" not in proc.stderr  # no dplab traceback from any rank
    assert (
        f'File "{REPO}/backends' not in proc.stderr and f'File "{REPO}/reference' not in proc.stderr
    )
    # torchrun names rank 0 as the first failure, with our exit code
    root = proc.stderr.split("Root Cause", 1)[1]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 2 " in root, proc.stderr
    assert proc.returncode != 0 and proc.stdout == ""


# The command stands in for ``train`` (whose start under torchrun waits in torch's store, in C++,
# where no Python handler runs): it says when the rank is inside it, then waits.
SLEEPER = """
import sys, time
from dplab.backends.cli import commands

def waits(args):
    print("inside", flush=True)
    time.sleep(120)

commands.ROWS["train"] = waits
sys.exit(commands.main(["train", "--backend", "torch"]))
"""


@pytest.mark.torch
@pytest.mark.parametrize("rank, said", [(0, ["dplab train: terminated"]), (1, [])])
def test_a_torchrun_rank_that_torchrun_stops_leaves_the_one_line_to_rank_0(rank, said):
    """torchrun stops every worker (SIGTERM) once one of them ends. A rank still starting then said
    "dplab train: terminated" beside rank 0's one-line error (seen across two hosts under load)."""
    _needs("torch")
    env = _env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "inside\n", proc.communicate(timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert [line for line in err.splitlines() if line.startswith("dplab ")] == said, err
    assert out == ""
