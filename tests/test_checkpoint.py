"""Checkpoints: bit-exact round trips, atomic saves under SIGKILL, and refusal of bad files.

The promise under test: whatever happens to a checkpoint file (a crash mid-save, a cut,
a flipped byte, a missing member, a config that moved on), ``load_checkpoint`` either
returns exactly what was saved or raises ``CheckpointError``. Never anything in between.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dplab.reference.checkpoint.store import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from dplab.reference.data import batch_indices
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.train.single import TrainConfig, setup, train_single

ROOT = Path(__file__).resolve().parents[1]
CFG = TrainConfig(optimizer=OptimConfig(name="adam", lr=0.01), steps=6)


def save(d: Path | str, step: int = 5, params: np.ndarray | None = None, **kw) -> Path:
    """A checkpoint with small but complete contents; keywords override any field."""
    args = {"optimizer_state": {"step": step, "exp_avg": np.arange(4.0), "exp_avg_sq": np.ones(4)},
            "data_position": step, "rng_state": np.random.default_rng(7).bit_generator.state,
            "meta": {"config": CFG}}
    args.update(kw)
    return save_checkpoint(d, step, np.linspace(-1, 1, 4) if params is None else params, **args)


def raw_checkpoint() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return save(d).read_bytes()


def assert_refused(raw: bytes, match: str = "corrupt") -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "ckpt-00000005.npz"
        p.write_bytes(raw)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(p)


def forge(raw: bytes, drop: tuple[str, ...] = (), edit=None, add: dict | None = None) -> bytes:
    """Rewrite a checkpoint's members and re-sign it: written from the format's description
    (a .npz whose archive comment, its last 64 bytes, is the SHA-256 hex of all before)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        members = {n: z.read(n) for n in z.namelist() if n not in drop}
    if edit is not None:
        m = json.loads(members["manifest.json"])
        edit(m)
        members["manifest.json"] = json.dumps(m).encode()
    members.update(add or {})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
        z.comment = b"0" * 64
    body = buf.getvalue()[:-64]
    return body + hashlib.sha256(body).hexdigest().encode()


# -- round trips -------------------------------------------------------------------------------

@given(arrays(st.sampled_from([np.float64, np.float32]), st.integers(0, 40)))
def test_params_round_trip_bit_exact(params: np.ndarray) -> None:
    with tempfile.TemporaryDirectory() as d:
        got = load_checkpoint(save(d, params=params)).params
    assert got.dtype == params.dtype and got.shape == params.shape
    assert got.tobytes() == params.tobytes()  # NaN payloads, -0.0 and inf included


def test_special_values_and_nan_payloads_survive(tmp_path: Path) -> None:
    bits = np.array(
        [0x7FF8000000000001, 0xFFF0000000000000, 0x8000000000000000, 0x7FF4000000000000],
        dtype=np.uint64,
    )  # a quiet NaN with payload, -inf, -0.0, a signalling NaN
    p64 = bits.view(np.float64)
    p32 = np.array([np.nan, np.inf, -0.0, 1e-45, -3.4e38], dtype=np.float32)
    for params in (p64, p32):
        ckpt = load_checkpoint(save(tmp_path, params=params))
        assert ckpt.params.tobytes() == params.tobytes() and ckpt.params.dtype == params.dtype


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_optimizer_continues_identically(tmp_path: Path, name: str, dtype: str) -> None:
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((6, 20)).astype(dtype)
    cfg = OptimConfig(name=name, lr=0.1, weight_decay=0.01)
    params, opt = rng.standard_normal(20).astype(dtype), make_optimizer(cfg, 20, dtype)
    for g in grads[:3]:
        opt.step(params, g)
    ckpt = load_checkpoint(save(tmp_path, 3, params, optimizer_state=opt.state_dict()))
    assert ckpt.optimizer_state["step"] == 3 and type(ckpt.optimizer_state["step"]) is int
    params2, opt2 = ckpt.params, make_optimizer(cfg, 20, dtype)
    opt2.load_state_dict(ckpt.optimizer_state)
    for g in grads[3:]:
        opt.step(params, g)
        opt2.step(params2, g)
        assert params2.tobytes() == params.tobytes()
    for k, v in opt.state_dict().items():
        assert np.asarray(opt2.state_dict()[k]).tobytes() == np.asarray(v).tobytes()


def _train(cfg: TrainConfig, steps: range, params: np.ndarray, opt) -> None:
    """train_single's loop from any step on: what a resumed run does."""
    model, data, _ = setup(cfg)
    grad = np.zeros_like(params)
    for step in steps:
        idx = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        grad[:] = 0
        model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / cfg.global_batch, grad)
        opt.step(params, grad)


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_resumed_training_equals_uninterrupted(tmp_path: Path, name: str) -> None:
    cfg = dataclasses.replace(CFG, optimizer=OptimConfig(name=name, lr=0.02))
    _, _, params = setup(cfg)
    opt = make_optimizer(cfg.optimizer, params.size)
    _train(cfg, range(2), params, opt)
    save_checkpoint(tmp_path, 2, params, opt.state_dict(), 2, None, {"config": cfg})
    ckpt = load_checkpoint(tmp_path, expect_meta={"config": cfg})
    opt2 = make_optimizer(cfg.optimizer, params.size)
    opt2.load_state_dict(ckpt.optimizer_state)
    _train(cfg, range(ckpt.data_position, cfg.steps), ckpt.params, opt2)
    assert ckpt.params.tobytes() == train_single(cfg).params.tobytes()


@pytest.mark.parametrize("bitgen", [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937,
                                    np.random.Philox, np.random.SFC64])
def test_rng_state_round_trip(tmp_path: Path, bitgen) -> None:
    gens = {"data": np.random.Generator(bitgen(1)), "delay": np.random.Generator(bitgen(2))}
    for g in gens.values():
        g.standard_normal(5)
        g.integers(0, 10, 3)  # leaves PCG64's has_uint32 flag set: part of the state too
    ckpt = load_checkpoint(
        save(tmp_path, rng_state={k: g.bit_generator.state for k, g in gens.items()})
    )
    for k, g in gens.items():
        fresh = np.random.Generator(bitgen())
        fresh.bit_generator.state = ckpt.rng_state[k]
        assert fresh.standard_normal(7).tobytes() == g.standard_normal(7).tobytes()
        assert np.array_equal(fresh.integers(0, 2**63, 5), g.integers(0, 2**63, 5))


def test_position_meta_and_values_round_trip(tmp_path: Path) -> None:
    position = {"step": 12, "clocks": [3, 4, 2], "version": 9}
    meta = {"config": CFG, "note": "ünïcode", "pair": (1, 2.5), "none": None, "flag": True,
            "big": 2**100, "nan": float("nan"), "table": np.arange(6, dtype=np.int16).reshape(2, 3)}
    ckpt = load_checkpoint(save(tmp_path, 12, data_position=position, rng_state=None, meta=meta))
    assert isinstance(ckpt, Checkpoint) and ckpt.step == 12 and ckpt.rng_state is None
    assert ckpt.data_position == position
    assert ckpt.meta["config"] == json.loads(json.dumps(dataclasses.asdict(CFG)))  # tuples -> lists
    assert (
        ckpt.meta["pair"] == [1, 2.5] and ckpt.meta["big"] == 2**100 and ckpt.meta["flag"] is True
    )
    assert (
        ckpt.meta["note"] == "ünïcode" and ckpt.meta["none"] is None and np.isnan(ckpt.meta["nan"])
    )
    assert ckpt.meta["table"].dtype == np.int16 and ckpt.meta["table"].tolist() == [
        [0, 1, 2],
        [3, 4, 5],
    ]
    assert load_checkpoint(save(tmp_path, 13, data_position=7)).data_position == 7
    assert save(tmp_path, 13).read_bytes() == save(tmp_path, 13).read_bytes()  # deterministic bytes


@pytest.mark.parametrize("bad", [
    {"step": -1}, {"step": 1.5}, {"params": [1.0, 2.0]}, {"params": np.array([object()])},
    {"meta": {1: "int key"}}, {"data_position": {"s": {1, 2}}}, {"meta": "not a dict"},
    {"optimizer_state": {"step": 1, "buf": np.array([None])}}, {"keep_last": 0},
])
def test_unstorable_input_is_refused_before_writing(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(ConfigError):
        save(tmp_path, **bad)
    assert list(tmp_path.iterdir()) == []


# -- directories: latest, pruning, strays ------------------------------------------------------

def test_latest_is_the_highest_complete_step_and_strays_are_ignored(tmp_path: Path, caplog) -> None:
    for step in (3, 99_999_999, 100_000_000, 7):
        save(tmp_path, step)
    stray = tmp_path / ".ckpt-200000000.npz.abc123.tmp"
    stray.write_bytes(b"half a checkpoint")
    listing = list_checkpoints(tmp_path)
    assert [p.name for p in listing.checkpoints] == [
        "ckpt-00000003.npz", "ckpt-00000007.npz", "ckpt-99999999.npz", "ckpt-100000000.npz"]
    assert listing.strays == (stray,) and listing.latest == tmp_path / "ckpt-100000000.npz"
    with caplog.at_level(logging.WARNING, logger="dplab.reference.checkpoint.store"):
        assert load_checkpoint(tmp_path).step == 100_000_000
    assert stray.name in caplog.text


def test_keep_last_prunes_oldest_but_never_the_new_one(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path).checkpoints] == [
        "ckpt-00000004.npz", "ckpt-00000005.npz"]
    save(tmp_path, 2, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path).checkpoints] == [
        "ckpt-00000002.npz", "ckpt-00000005.npz"]


def test_empty_or_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / ".ckpt-00000001.npz.x.tmp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint in .*1 unfinished"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "ckpt-00000001.npz")
    assert issubclass(CheckpointError, DplabError)


# -- atomicity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fails", ["replace", "fsync"])
def test_failed_save_leaves_previous_checkpoint_latest(
    tmp_path: Path, monkeypatch, fails: str
) -> None:
    save(tmp_path, 1, np.ones(4))

    def boom(*args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fails, boom)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, 2, np.full(4, 2.0))
    monkeypatch.undo()
    listing = list_checkpoints(tmp_path)
    assert [p.name for p in listing.checkpoints] == ["ckpt-00000001.npz"] and listing.strays == ()
    assert load_checkpoint(tmp_path).params.tolist() == [1.0] * 4


CHILD = """
import os, sys, time
import numpy as np
from dplab.reference.checkpoint.store import save_checkpoint
d, phase, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
save = lambda s: save_checkpoint(d, s, np.full(n, float(s)), {"step": s}, s, None, {"n": n})
save(1)
def hang(*a, **k):
    print("hanging", flush=True)
    time.sleep(60)
if phase == "write":  # hang with half the bytes in the temporary file
    fdopen = os.fdopen
    class Half:
        def __init__(self, f): self.f = f
        def __enter__(self): return self
        def __exit__(self, *a): self.f.close()
        def write(self, b): self.f.write(b[: len(b) // 2]); self.f.flush(); hang()
    os.fdopen = lambda *a, **k: Half(fdopen(*a, **k))
elif phase in ("fsync", "replace"):
    setattr(os, phase, hang)
else:  # "loop": save ever more checkpoints until killed at a random moment
    print("hanging", flush=True)
for s in range(2, 10**6 if phase == "loop" else 3):  # a save that never hangs: fail, not wait
    save(s)
"""


def _start_child(d: Path, phase: str, n: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(d), phase, str(n)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "hanging\n"
    return child


def _kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL
    child.stdout.close()


@pytest.mark.parametrize("phase", ["write", "fsync", "replace"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path: Path, phase: str) -> None:
    _kill(_start_child(tmp_path, phase, 100_000))
    listing = list_checkpoints(tmp_path)
    assert [p.name for p in listing.checkpoints] == ["ckpt-00000001.npz"]
    assert len(listing.strays) == 1 and listing.strays[0].name.startswith(".ckpt-00000002.npz.")
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and np.all(ckpt.params == 1.0) and ckpt.params.size == 100_000
    if phase == "write":
        with pytest.raises(CheckpointError, match="corrupt"):
            load_checkpoint(listing.strays[0])


def test_sigkill_at_random_moments_never_leaves_a_bad_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(0)
    for trial in range(3):
        d = tmp_path / str(trial)
        child = _start_child(d, "loop", 1_000_000)  # 8 MB per save: kills land mid-write too
        time.sleep(rng.uniform(0.05, 0.4))
        _kill(child)
        listing = list_checkpoints(d)
        for p in listing.checkpoints:  # every complete file is whole and is what its name says
            ckpt = load_checkpoint(p, expect_meta={"n": 1_000_000})
            assert np.all(ckpt.params == ckpt.step) and ckpt.data_position == ckpt.step
        assert load_checkpoint(d).step == len(listing.checkpoints)  # steps 1..k, nothing skipped


# -- corruption --------------------------------------------------------------------------------

RAW = raw_checkpoint()


@pytest.mark.parametrize("keep", [0, 1, 4, 30, 100, len(RAW) // 2, len(RAW) - 65, len(RAW) - 64,
                                  len(RAW) - 1])
def test_truncated_file_is_refused(keep: int) -> None:
    assert_refused(RAW[:keep])


@given(
    st.lists(st.tuples(st.integers(0, len(RAW) - 1), st.integers(1, 255)), min_size=1, max_size=4)
)
def test_flipped_bytes_are_refused(flips: list[tuple[int, int]]) -> None:
    raw = bytearray(RAW)
    for pos, xor in flips:
        raw[pos] ^= xor
    if bytes(raw) != RAW:  # two flips of one byte may cancel out
        assert_refused(bytes(raw))


def test_every_byte_is_covered_by_the_checksum(tmp_path: Path) -> None:
    p = tmp_path / "ckpt-00000005.npz"
    for pos in range(len(RAW)):  # flip the top bit of each byte in turn, headers and digest too
        p.write_bytes(RAW[:pos] + bytes([RAW[pos] ^ 0x80]) + RAW[pos + 1:])
        with pytest.raises(CheckpointError, match="corrupt"):
            load_checkpoint(p)


@given(st.binary(min_size=1, max_size=100))
def test_appended_bytes_are_refused(extra: bytes) -> None:
    assert_refused(RAW + extra)


def test_unchanged_file_loads_and_forge_matches_the_format() -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "ckpt-00000005.npz"
        p.write_bytes(forge(RAW))
        assert load_checkpoint(p).params.tolist() == np.linspace(-1, 1, 4).tolist()


@pytest.mark.parametrize("member", ["optimizer/exp_avg.npy", "params.npy", "manifest.json"])
def test_missing_member_is_refused(member: str) -> None:
    with zipfile.ZipFile(io.BytesIO(RAW)) as z:
        assert member in z.namelist()
    assert_refused(forge(RAW, drop=(member,)), match=f"missing member {member}")


def test_deleted_member_without_resigning_is_corrupt() -> None:
    with zipfile.ZipFile(io.BytesIO(RAW)) as z:
        members = {n: z.read(n) for n in z.namelist() if n != "params.npy"}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
        z.comment = RAW[-64:]  # the old checksum
    assert_refused(buf.getvalue())


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(version=FORMAT_VERSION + 1), f"format version {FORMAT_VERSION + 1}"),
    (lambda m: m.update(format="something-else"), "not a dplab-checkpoint file"),
    (lambda m: m.pop("meta"), "KeyError"),
    (lambda m: m.update(step=6), "holds step 6, not the step in its name"),
])
def test_bad_manifest_is_refused(edit, match: str) -> None:
    assert_refused(forge(RAW, edit=edit), match=match)


def test_pickled_member_is_refused_not_run() -> None:
    evil = io.BytesIO()
    np.lib.format.write_array(evil, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    assert_refused(forge(RAW, add={"params.npy": evil.getvalue()}), match="unreadable.*pickle")


# -- configuration mismatch --------------------------------------------------------------------

def test_same_config_is_accepted(tmp_path: Path) -> None:
    save(tmp_path)
    assert load_checkpoint(tmp_path, expect_meta={"config": CFG}).step == 5
    assert load_checkpoint(tmp_path, expect_meta={"config": dataclasses.asdict(CFG)}).step == 5


@pytest.mark.parametrize("change, field", [
    ({"seed": 1}, "meta.config.seed: checkpoint has 0, this run has 1"),
    ({"optimizer": OptimConfig(name="adam", lr=0.5)}, "meta.config.optimizer.lr: checkpoint has "
                                                      "0.01"),
    ({"optimizer": OptimConfig(name="sgd", lr=0.01)}, "meta.config.optimizer.name: checkpoint has "
                                                      "adam"),
    ({"dtype": "float32"}, "meta.config.dtype"),
    ({"global_batch": 64}, "meta.config.global_batch: checkpoint has 32, this run has 64"),
])
def test_config_mismatch_names_the_field(tmp_path: Path, change: dict, field: str) -> None:
    save(tmp_path)
    with pytest.raises(CheckpointError, match="different configuration") as e:
        load_checkpoint(tmp_path, expect_meta={"config": dataclasses.replace(CFG, **change)})
    assert field in str(e.value)


def test_meta_key_missing_on_either_side_is_a_mismatch(tmp_path: Path) -> None:
    save(tmp_path, meta={"config": CFG, "run": "a"})
    with pytest.raises(CheckpointError, match="meta.run: checkpoint has a, this run has <absent>"):
        load_checkpoint(tmp_path, expect_meta={"config": CFG})
    with pytest.raises(CheckpointError, match="meta.extra: checkpoint has <absent>"):
        load_checkpoint(tmp_path, expect_meta={"config": CFG, "run": "a", "extra": 1})
