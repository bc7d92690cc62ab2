"""Inputs a hostile tester tried (issue 28, round 3): each ends in one line of error, exit 2, within
seconds and bounded memory, and leaves nothing behind.

- ``--resume`` of a link to /dev/zero, a FIFO, a zip bomb, a 30 GB sparse file;
- algorithm parameters past any meaning (``pipelined_ring:1000000``);
- models and batches that cannot fit in memory (``--hidden 100000000``);
- a tune file whose fields are finite but whose prices are not (``alpha_s: 1e308``);
- a ``--checkpoint-dir`` that is a loop of links;
- outputs that cannot be written mid-run (a full disk, a directory in the way, a read-only place).

The commands run as the user runs them, in a subprocess under a 3 GiB address-space limit and a
timeout: before the fixes each of them hung, grew without bound or printed a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import resource
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.fastpath.arrays import ALLREDUCE as ARRAYS
from dplab.backends.local.shm import leftovers
from dplab.backends.runs.memory import check_run, train_bytes
from dplab.backends.runs.run import RunSpec
from dplab.reference import auto
from dplab.reference.algorithms import ALLREDUCE, PARAMETER_MAX, has_schedule
from dplab.reference.checkpoint import store
from dplab.reference.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from dplab.reference.columns import columns
from dplab.reference.costfit import CostFit
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
AS_LIMIT = 3 << 30  # bytes of address space each process of a hostile command may map
SMALL = ["--world-size", "2", "--steps", "2"]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def dplab(*argv: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """``dplab ARGV`` as a user runs it, under ``AS_LIMIT`` and ``timeout`` (a hang fails)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "dplab.backends.cli", *argv]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_limited, cwd=ROOT, env={**os.environ, **(env or {})}) as run:
        try:
            out, err = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            raise
    done = subprocess.CompletedProcess(cmd, run.returncode, out, err)
    done.seconds, done.pid = time.monotonic() - t0, run.pid
    return done


def refused(done: subprocess.CompletedProcess, *words: str) -> str:
    """The command ended in exit 2 and one line on stderr that says ``words``, leaving no segment
    in /dev/shm; returns that line."""
    err = done.stderr.strip()
    if hasattr(done, "pid"):  # its worlds' segments are named after it
        assert leftovers(f"dplab_{done.pid}_") == []
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


# -- 1. --resume reads only what this run's checkpoint can be --------------------------------------

def _resign(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    """A checkpoint-shaped zip whose checksum holds (what a hostile file can always arrange)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.comment = b"0" * 64
    body = buf.getvalue()[:-64]
    return body + hashlib.sha256(body).hexdigest().encode()


def test_resume_from_a_link_to_dev_zero_is_refused(tmp_path):
    (tmp_path / "ckpt.npz").symlink_to("/dev/zero")
    refused(dplab("train", *SMALL, "--resume", str(tmp_path / "ckpt.npz")), "is a device")


def test_resume_from_a_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "ckpt.npz")
    refused(dplab("train", *SMALL, "--resume", str(tmp_path / "ckpt.npz"), timeout=30), "is a FIFO")


def test_resume_from_a_zip_bomb_is_refused_unopened(tmp_path):
    # 64 MiB of zeros deflate to 64 KiB: within the size a checkpoint of this run may have
    bomb = _resign({"manifest.json": bytes(64 << 20)}, zipfile.ZIP_DEFLATED)
    assert len(bomb) < 100 << 10
    (tmp_path / "ckpt.npz").write_bytes(bomb)
    refused(dplab("train", *SMALL, "--resume", str(tmp_path / "ckpt.npz")), "is compressed")


def test_resume_from_a_huge_sparse_file_is_refused_by_its_size(tmp_path):
    with open(tmp_path / "ckpt.npz", "wb") as f:
        f.truncate(30 << 30)  # 30 GiB, no block allocated
    err = refused(dplab("train", *SMALL, "--resume", str(tmp_path / "ckpt.npz")), "30.0 GiB")
    assert "more than the" in err


def test_a_member_larger_than_the_model_is_refused_before_it_is_read(tmp_path):
    path = save_checkpoint(tmp_path, 1, np.zeros(1000), {"step": 1}, 1, None, {})
    with pytest.raises(CheckpointError, match="params.npy holds 7.9 KiB, more than"):
        load_checkpoint(path, bounds=store.Bounds(array_bytes=800, manifest_bytes=1 << 16))
    assert load_checkpoint(path, bounds=store.Bounds(8000, 1 << 16)).params.size == 1000


def test_an_array_header_larger_than_its_data_is_refused_unallocated(tmp_path):
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False,
                                                "shape": (10**12,)})
    good = save_checkpoint(tmp_path, 1, np.zeros(4), {"step": 1}, 1, None, {})
    with zipfile.ZipFile(good) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["params.npy"] = head.getvalue() + bytes(32)
    (tmp_path / "ckpt-00000001.npz").write_bytes(_resign(members))
    with pytest.raises(CheckpointError, match=r"array header of \[1000000000000\] float64 over 32"):
        load_checkpoint(tmp_path)


# -- 3. algorithm parameters have a stated maximum, the same in every builder ----------------------

@pytest.mark.parametrize("algorithm", ["pipelined_ring:1000000", "double_tree:99999999999",
                                       "pipelined_ring:99999999999", "pipelined_tree:1025",
                                       "hierarchical:99999999999"])
def test_a_parameter_past_its_maximum_is_refused_before_any_rank(algorithm):
    name = algorithm.split(":")[0]
    top = PARAMETER_MAX[name][0]
    done = dplab("train", *SMALL, "--algorithm", algorithm, timeout=60)
    assert done.seconds < 30
    refused(done, f"at most {top}", algorithm)


@pytest.mark.parametrize("name", sorted(PARAMETER_MAX))
def test_every_builder_takes_the_maximum_and_refuses_one_more(name):
    top = PARAMETER_MAX[name][0]
    readable = ALLREDUCE[name]
    with pytest.raises(ConfigError, match=str(top)):
        readable(3, top + 1)
    with pytest.raises(ConfigError, match=f"at most {top}"):
        has_schedule(f"{name}:{top + 1}")
    assert has_schedule(f"{name}:{top}")
    built = readable(3, top)
    if name in ARRAYS:  # the engine's array builders: the same bound, the same schedule
        with pytest.raises(ConfigError, match=str(top)):
            ARRAYS[name](3, top + 1)
        assert ARRAYS[name](3, top).equals(columns(built))


def _huge_slices(comm):
    from dplab.backends import allreduce

    return allreduce(comm, np.ones(4), algorithm="pipelined_ring:100000000")


@pytest.mark.timeout(60)
def test_the_python_api_refuses_a_huge_parameter_in_one_line():
    from dplab.backends.launch.world import RankError, launch

    with pytest.raises(RankError) as e:
        launch(_huge_slices, 2)
    assert "at most 1024" in (e.value.config_error() or "")


# -- 5. a tune file whose fields are finite but whose prices are not -------------------------------

def _tune(tmp_path, alpha: float) -> Path:
    fits = (CostFit("local", "all", "all", alpha, 0.0, 1 / 5.8e9),
            CostFit("local", "all", "native", 95e-6, 1 / 5.2e9, None))
    return auto.save_tuning(auto.Tuning(fits, "test"), tmp_path / "tune.json")


def test_a_tune_file_pricing_at_inf_is_refused_before_any_rank(tmp_path, cli_here, monkeypatch):
    monkeypatch.setenv("DPLAB_TUNE", str(_tune(tmp_path, 1e308)))
    auto.reset()
    try:
        done = cli_here("train", *SMALL, "--algorithm", "auto")
    finally:
        monkeypatch.delenv("DPLAB_TUNE")
        auto.reset()
    refused(done, "tune.json", "no finite time", "dplab tune")


def test_a_price_that_overflows_at_a_larger_world_is_refused_where_it_is_priced(tmp_path):
    tuning = auto.load_tuning(_tune(tmp_path, 1e307))  # 2 ranks: 2 messages, 2e307 s: finite
    assert tuning.choose("local", 2, 1 << 20) in (*ALLREDUCE, "native")
    with pytest.raises(ConfigError, match="prices .* on 16 ranks at (inf|nan) s"):
        tuning.choose("local", 16, 1 << 20)  # 30 rounds of 1e307 s


# -- 6, 7. outputs: checked up front where they can be, written whole or not at all ---------------

def test_a_checkpoint_dir_that_is_a_loop_of_links_is_refused_up_front(tmp_path, cli_here):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    refused(cli_here("train", *SMALL, "--checkpoint-every", "1", "--checkpoint-dir",
                     str(tmp_path / "a")), "symbolic link", "--checkpoint-dir")


def test_an_output_file_that_is_a_loop_of_links_is_refused_up_front(tmp_path, cli_here):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    refused(cli_here("train", *SMALL, "--json", str(tmp_path / "a")), "symbolic link", "--json")


def test_a_directory_where_the_chrome_trace_goes_is_refused_up_front(tmp_path, cli_here):
    (tmp_path / "run.chrome.json").mkdir()
    refused(cli_here("train", *SMALL, "--trace", str(tmp_path / "run.json")),
            "run.chrome.json is a directory")


@pytest.fixture
def small_disk(tmp_path):
    """``mount(kib)``: a tmpfs of that many KiB at a fresh directory, unmounted afterwards. A full
    disk for real: the writes fail with ENOSPC where a user's would."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs, and mounting one needs root (or run pytest "
                    "inside `unshare --user --map-root-user --mount`)")
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(d)], check=True)
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _left(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob("*"))


@pytest.mark.parametrize("option, name", [("--json", "rows.json"), ("--trace", "run.json"),
                                          ("--save-params", "params.npy")])
def test_a_full_disk_at_the_end_of_a_run_is_one_line_and_the_old_file_stays(small_disk, option,
                                                                          name):
    d = small_disk(4)  # one page: the old file fills it
    (d / name).write_text("the good old file")
    err = refused(dplab("train", *SMALL, option, str(d / name)), "No space left on device",
                  f"{option}", "nothing was left half-written")
    assert str(d / name) in err
    assert (d / name).read_text() == "the good old file" and _left(d) == [name]


def test_a_checkpoint_dir_that_fills_mid_run_stops_the_run_in_one_line(small_disk):
    d = small_disk(64)  # room for the first checkpoint of the default model (43 KB), not a second
    err = refused(dplab("train", *SMALL, "--steps", "5", "--checkpoint-every", "1",
                        "--checkpoint-dir", str(d / "ck")), "rank 0: checkpoint", "No space left")
    assert "ckpt-00000002.npz" in err
    assert _left(d) == ["ck", "ckpt-00000001.npz"]  # the one that fitted, whole; no temporary
    assert load_checkpoint(d / "ck").step == 1


def test_a_temporary_the_file_system_will_not_delete_is_named_in_the_one_line(tmp_path,
                                                                             monkeypatch):
    """A remount read-only between the temporary's creation and its write: the write fails and
    so does the delete; the line must not say "nothing was left" (CI saw the temporary stay)."""
    from dplab.reference import files

    def remounted(f):
        raise OSError(errno.EROFS, "Read-only file system")

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files.os, "unlink", refuse)
    with pytest.raises(files.WriteError) as e:
        files.write_atomic(tmp_path / "ckpt.npz", remounted, "checkpoint")
    (stray,) = [p for p in tmp_path.iterdir()]
    assert f"kept the unfinished {stray}: delete it" in str(e.value)
    assert "nothing was left" not in str(e.value) and not (tmp_path / "ckpt.npz").exists()


def _remount_read_only(mount: Path) -> None:
    """``mount -o remount,ro``, retried: Linux refuses it ("mount point is busy") while a file on
    it is open for writing, as the run's next checkpoint is for part of every step."""
    deadline = time.monotonic() + 30
    while (done := subprocess.run(["mount", "-o", "remount,ro", str(mount)],
                                  capture_output=True, text=True)).returncode != 0:
        assert "busy" in done.stderr and time.monotonic() < deadline, done.stderr
        time.sleep(0.01)


def test_a_checkpoint_dir_that_turns_read_only_mid_run_stops_the_run_in_one_line(small_disk):
    d = small_disk(1 << 20)  # 1 GiB of room: only the remount can stop the run
    cmd = [sys.executable, "-m", "dplab.backends.cli", "train", "--world-size", "2", "--steps",
           "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(d / "ck")]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT)
    try:
        while not (d / "ck" / "ckpt-00000001.npz").exists():
            assert run.poll() is None, run.stderr.read()
            time.sleep(0.01)
        _remount_read_only(d)
        err = run.communicate(timeout=60)[1]
    finally:
        run.kill()
        run.wait()
    done = subprocess.CompletedProcess(cmd, run.returncode, "", err)
    done.pid = run.pid
    err = refused(done, "rank 0: checkpoint", "Read-only file system")
    # A save caught mid-write by the remount cannot delete its temporary (the file system keeps
    # what it holds): then the line names it, so nothing is left unsaid.
    for stray in [p for p in (d / "ck").iterdir() if p.name.endswith(".tmp")]:
        assert f"kept the unfinished {stray}: delete it" in err
    assert load_checkpoint(d / "ck").step >= 1


# -- 4. sizes that cannot fit in memory are refused, with how much too much ------------------------

@pytest.mark.parametrize("argv, words", [
    (["--hidden", "100000000"], "use a smaller model (--hidden, --in-dim)"),
    (["--global-batch", "1000000000"], "use a smaller --global-batch or more --accum-steps"),
    (["--num-samples", "1000000000"], "use a smaller --num-samples"),
    (["--hidden", "20000,20000", "--zero-stage", "3"], "use a smaller model"),
    (["--hidden", "20000,20000", "--mode", "async"], "use a smaller model"),
])
def test_a_run_that_cannot_fit_in_memory_is_refused_before_any_rank(cli_here, argv, words):
    err = refused(cli_here("train", *SMALL, *argv), "too much", words)
    assert "of memory" in err or "of /dev/shm" in err


def _spec(**train) -> RunSpec:
    return RunSpec("local", 4, train=replace(TrainConfig(), **train))


def test_the_estimate_grows_with_the_model_the_batch_and_the_data():
    base = train_bytes(_spec(), 4)
    wide = train_bytes(_spec(model=MLPConfig(8, (4096,), 4)), 4)
    batch = train_bytes(_spec(global_batch=1 << 20), 4)
    data = train_bytes(_spec(num_samples=1 << 20), 4)
    assert wide.replica > 100 * base.replica and batch.step > 100 * base.step
    assert data.data > 100 * base.data
    # ZeRO-3 shards Adam's model state: a quarter per rank on 4 ranks, plus one gathered layer
    # (and the first weights, which every rank draws whole)
    big = replace(_spec(model=MLPConfig(8, (1024,) * 8, 4), optimizer=OptimConfig("adam")),
                  zero_stage=3)
    assert train_bytes(big, 4).replica < 0.5 * train_bytes(replace(big, zero_stage=None), 4).replica


def test_runs_that_fit_are_let_through(monkeypatch):
    for spec in (_spec(), _spec(model=MLPConfig(16, (512, 512), 4), global_batch=4096)):
        check_run(spec)  # no error on this machine: a few MiB each


def test_tune_from_a_fifo_or_a_device_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / "rows.json")
    refused(dplab("tune", "--from-json", str(tmp_path / "rows.json"), "--out",
                  str(tmp_path / "tune.json"), timeout=30), "is a FIFO")
    refused(dplab("tune", "--from-json", "/dev/zero", "--out", str(tmp_path / "tune.json")),
            "is a device")
