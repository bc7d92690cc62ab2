"""Bad arguments are refused up front: one line on stderr, exit 2, before any rank starts.

Each case below used to fail late (after the run, with a traceback, the results lost), deep in
a rank, with a ZeroDivisionError, or not at all. ``--steps 1000000`` makes "late" obvious: a
check that ran after the work would not answer within the timeout. Most cases run ``main`` in
this process (conftest's ``cli_here``: starting a world there fails the test); one case per
command still runs ``python -m dplab.backends.cli`` as a process, for its exit code and stderr.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dplab.backends.bench import spec
from dplab.backends.bench.spec import MemoryNeed, bench_memory_need
from dplab.backends.cli import checks
from dplab.reference.errors import ConfigError

LONG = ["--steps", "1000000"]
M = 1 << 20


def _dplab(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dplab.backends.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


def _refused(proc: subprocess.CompletedProcess, command: str, message: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dplab {command}: error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("option", ["--json", "--trace", "--save-params"])
def test_output_file_in_a_missing_directory(cli_here, tmp_path, option):
    target = tmp_path / "no" / "such" / "out.json"
    _refused(cli_here("train", *LONG, option, str(target)), "train",
             f"directory {target.parent} does not exist")


@pytest.mark.parametrize("option", ["--json", "--trace", "--save-params"])
def test_output_file_in_an_unwritable_place(cli_here, option):
    _refused(cli_here("train", *LONG, option, "/proc/dplab-out.json"), "train", "cannot write in "
                                                                                "/proc")


def test_output_file_that_is_a_directory(tmp_path):
    # a process
    _refused(_dplab("compare", *LONG, "--json", str(tmp_path)), "compare", "is a directory")


def test_an_output_path_refused_by_the_module_as_run(tmp_path):
    """The in-process cases above, as a process: exit 2 from ``python -m``, one line, nothing
    else."""
    _refused(
        _dplab("train", *LONG, "--json", str(tmp_path / "no" / "out.json")),
        "train",
        "does not exist",
    )


def test_checkpoint_dir_missing_parent_unwritable_or_a_file(cli_here, tmp_path):
    missing = tmp_path / "no" / "ck"
    _refused(
        cli_here("train", *LONG, "--checkpoint-every", "5", "--checkpoint-dir", str(missing)),
        "train",
        "does not exist",
    )
    _refused(
        cli_here("train", *LONG, "--checkpoint-every", "5", "--checkpoint-dir", "/proc/ck"),
        "train",
        "cannot write in /proc",
    )
    afile = tmp_path / "file"
    afile.write_text("x")
    _refused(cli_here("train", *LONG, "--checkpoint-dir", str(afile)), "train", "is a file, not a "
                                                                                "directory")


def test_a_writable_place_passes_and_leaves_no_probe_behind(tmp_path):
    checks.check_output_file("--json", str(tmp_path / "rows.json"))
    checks.check_output_dir("--checkpoint-dir", str(tmp_path / "ck"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--sizes", "0"], "size must be at least one element"),
        (["bench", "--sizes", "4K,2"], "size 2 bytes is less than one float32 element (4 bytes)"),
        (["bench", "--sizes", "4", "--dtype", "float64"], "less than one float64 element"),
        (["bench", "--max-iters", "0"], "--max-iters: must be an integer >= 1, got 0"),
        (["bench", "--algorithms", "ring,foo"], "unknown algorithm 'foo'"),
        (["bench", "--world-sizes", "2,0"], "world_size must be a positive integer, got 0"),
        (
            ["bench", "--target-seconds", "nan"],
            "--target-seconds: must be a finite number > 0, got nan",
        ),
        (["bench", "--sizes", "1024G"], "of /dev/shm in all, but"),
        (["bench", "--device", "cuda"], "--device cuda picks the torch backend's device"),
        (["train", *LONG, "--device", "cuda"], "backend local has no device choice"),
        (
            ["train", *LONG, "--backend", "cuda", "--device", "cpu"],
            "backend cuda has no device choice",
        ),
        (["compare", *LONG, "--device", "cpu", "--backends", "local,mpi"], "drop --device"),
        (
            ["train", *LONG, "--bucket-cap-mb", "nan"],
            "--bucket-cap-mb: must be a finite number > 0, got nan",
        ),
        (["train", *LONG, "--bucket-cap-mb", "inf"], "must be a finite number > 0, got inf"),
        (["train", *LONG, "--bucket-cap-mb", "-1"], "must be a finite number > 0, got -1"),
        (["train", *LONG, "--lr", "nan"], "--lr: must be a finite number > 0"),
        (["compare", *LONG, "--backends", ""], "--backends: empty list ''"),
        (["compare", *LONG, "--algorithms", ","], "--algorithms: empty list ','"),
        (["compare", *LONG, "--world-sizes", ""], "empty list"),
        (["compare", *LONG, "--modes", ""], "empty list"),
        (["compare", *LONG, "--staleness-grid", ""], "empty list"),
        (["bench", "--sizes", ""], "empty list"),
        (["bench", "--backends", ""], "empty list"),
    ],
)
def test_refused_up_front(cli_here, argv, message):
    _refused(cli_here(*argv), argv[0], message)  # cli_here fails the test if a world starts


@pytest.mark.parametrize("argv, message", [
    (["bench", "--world-sizes", "2,0"], "world_size must be a positive integer, got 0"),
    (["train", *LONG, "--bucket-cap-mb", "nan"], "--bucket-cap-mb: must be a finite number > 0, "
                                                 "got nan"),
    (["compare", *LONG, "--backends", ""], "--backends: empty list ''"),
])
def test_refused_up_front_by_the_module_as_run(argv, message):
    """One case per command as a real process: exit 2, one line on stderr, and fast (not run)."""
    t0 = time.perf_counter()
    _refused(_dplab(*argv), argv[0], message)
    assert time.perf_counter() - t0 < 30  # refused, not run


def test_the_cuda_backend_takes_device_cuda_as_said(cli_here):
    """Its ranks are on the GPU anyway: --device cuda is no error (here the missing GPU is)."""
    from dplab.backends.cuda.setup import available

    if available() is None:
        pytest.skip("this machine has a GPU: the command would start ranks")
    err = cli_here("train", "--backend", "cuda", "--device", "cuda", "--world-size", "2").stderr
    assert "no device choice" not in err and "no CUDA GPU" in err, err


def test_an_empty_hidden_list_is_a_linear_model_not_an_error(tmp_path):
    from dplab.backends.cli.commands import main

    out = tmp_path / "rows.json"
    assert (
        main(["train", "--hidden", "", "--world-size", "2", "--steps", "2", "--json", str(out)])
        == 0
    )
    assert out.exists()


def test_bench_memory_need_counts_every_rank_and_the_memcpy():
    need = bench_memory_need("local", 4, [4096, M, 16 * M, 64 * M])
    # a rank holds the 64M buffer and, while it is allocated, the 16M one before it
    assert need == MemoryNeed("local", 4, per_rank=80 * M, shm=320 * M, ram=320 * M + 128 * M)
    mpi = bench_memory_need("mpi", 2, [64 * M, 4096])  # + a scratch copy in the engine's all-reduce
    per_rank = (64 * M + 4096) + 64 * M
    assert mpi == MemoryNeed("mpi", 2, per_rank=per_rank, shm=0, ram=2 * per_rank + 128 * M)


def test_memory_is_checked_against_free_shm_and_mem_available(monkeypatch):
    from argparse import Namespace

    a = Namespace(
        command="bench",
        backends=["local"],
        world_sizes=[2, 4],
        algorithms=["ring"],
        sizes=[64 * M],
        dtype="float32",
        reps=1,
        target_seconds=0.1,
        warmup=0,
        max_iters=10,
        device=None,
        json=None,
    )
    monkeypatch.setattr(spec, "shm_free_bytes", lambda: 255 * M)
    monkeypatch.setattr(spec, "mem_available_bytes", lambda: 10 << 30)
    with pytest.raises(ConfigError, match=r"world size 4 .* 256\.0 MiB of /dev/shm in all, but "
                                          r"255\.0 MiB"):
        checks.check_args(a)
    monkeypatch.setattr(spec, "shm_free_bytes", lambda: 256 * M)
    checks.check_args(a)  # exactly enough
    monkeypatch.setattr(spec, "mem_available_bytes", lambda: 300 * M)  # 256M shm + 128M memcpy
    with pytest.raises(ConfigError, match="MemAvailable"):
        checks.check_args(a)
