"""Checkpoints: a training run's whole state in one file, saved atomically, loaded bit for bit.

    save_checkpoint("ckpts", step, params, opt.state_dict(), step, None, {"config": cfg})
    ckpt = load_checkpoint("ckpts", expect_meta={"config": cfg})  # a directory: its latest
    params[:] = ckpt.params; opt.load_state_dict(ckpt.optimizer_state)

Contract: ATOMIC (a temporary file, fsynced, ``os.replace``d onto ``ckpt-<step>.npz``, then the
directory fsynced: the latest is the highest complete step); VERIFIED (the last 64 bytes are the
SHA-256 of the rest, checked before parsing: a truncated or altered file raises
``CheckpointError``; accidents, not attackers); INERT (no pickle: .npy members and one JSON
member). ``np.load(path)`` opens it for a look (``["manifest.json"]`` is the JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dplab.reference.errors import ConfigError, DplabError

__all__ = ["CheckpointError", "Checkpoint", "Listing", "FORMAT", "FORMAT_VERSION",
           "save_checkpoint", "load_checkpoint", "list_checkpoints"]

FORMAT, FORMAT_VERSION = "dplab-checkpoint", 1
_NAME = re.compile(r"ckpt-(\d{8,})\.npz")  # complete checkpoints; temporaries start with "."
_DIGEST_LEN = 64  # hex SHA-256, stored as the zip's archive comment: the file's last bytes
_MANIFEST = "manifest.json"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: the same state gives the same bytes
log = logging.getLogger(__name__)


class CheckpointError(DplabError):
    """A checkpoint that must not be resumed from; the message says what to do instead."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint. Its arrays are fresh copies that belong to the caller."""

    path: Path
    step: int
    params: np.ndarray
    optimizer_state: dict[str, np.ndarray | int]
    data_position: dict | int
    rng_state: dict | None
    meta: dict


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a checkpoint directory holds."""

    checkpoints: tuple[Path, ...]  # complete checkpoints, lowest step first
    strays: tuple[Path, ...]  # temporaries of saves that never finished: ignored, safe to delete

    @property
    def latest(self) -> Path | None:
        return self.checkpoints[-1] if self.checkpoints else None


def list_checkpoints(directory: str | os.PathLike) -> Listing:
    """The complete checkpoints of ``directory`` by step, and the stray temporaries beside them."""
    d = Path(directory)
    names = [p.name for p in d.iterdir()] if d.is_dir() else []
    done = sorted((int(m.group(1)), d / n) for n in names if (m := _NAME.fullmatch(n)))
    strays = sorted(d / n for n in names if n.startswith(".ckpt-") and n.endswith(".tmp"))
    return Listing(tuple(p for _, p in done), tuple(strays))


def save_checkpoint(directory: str | os.PathLike, step: int, params: np.ndarray,
                    optimizer_state: dict, data_position: dict | int, rng_state: dict | None,
                    meta: dict, *, keep_last: int | None = None) -> Path:
    """Write ``<directory>/ckpt-<step>.npz`` atomically and return its path.

    JSON-side values (optimizer ints, data position, RNG state, meta) may be numbers,
    strings, None, lists, tuples (they come back as lists), dicts with str keys, dataclasses
    (stored as dicts) and numpy arrays (as in MT19937's RNG state). ``keep_last=k`` then
    deletes all but the k highest-step checkpoints (never the one just written).
    """
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    data = _encode(step, params, optimizer_state, data_position, rng_state, meta)  # checks first
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{step:08d}.npz"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    if keep_last is not None:
        for old in list_checkpoints(d).checkpoints[:-keep_last]:
            if old != final:
                old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | os.PathLike, *, expect_meta: dict | None = None) -> Checkpoint:
    """Load a checkpoint file, or the latest complete one of a directory, verified whole.

    ``expect_meta``: the metadata this run would write; a checkpoint whose metadata differs
    is refused with an error naming the differing fields.
    """
    p = Path(path)
    if p.is_dir():
        listing = list_checkpoints(p)
        if listing.strays:
            log.warning("ignoring unfinished temporary files of interrupted saves (safe to "
                        "delete): %s", ", ".join(str(s) for s in listing.strays))
        if listing.latest is None:
            raise CheckpointError(f"no checkpoint in {p} (only ckpt-<step>.npz files count; "
                                  f"{len(listing.strays)} unfinished temporaries ignored): "
                                  "start without resuming, or point at the right directory")
        p = listing.latest
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {p} ({e.strerror}): check the path") from e
    body, digest = raw[:-_DIGEST_LEN], raw[-_DIGEST_LEN:]
    if len(raw) <= _DIGEST_LEN or hashlib.sha256(body).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {p} is corrupt (checksum mismatch: truncated or "
                              "altered): delete it or resume from an earlier one")
    ckpt = _decode(p, raw)
    m = _NAME.fullmatch(p.name)
    if m and int(m.group(1)) != ckpt.step:
        raise CheckpointError(f"checkpoint {p} holds step {ckpt.step}, not the step in its name: "
                              f"rename it to ckpt-{ckpt.step:08d}.npz or delete it")
    if expect_meta is not None:
        diffs = _diff(ckpt.meta, _decode_json(json.loads(json.dumps(_plain(expect_meta, "meta")))))
        if diffs:
            shown = "; ".join(f"{k}: checkpoint has {a}, this run has {b}" for k, a, b in diffs[:5])
            raise CheckpointError(f"checkpoint {p} was written by a different configuration "
                                  f"({shown}{'; ...' if len(diffs) > 5 else ''}): resume with the "
                                  "same configuration, or checkpoint into a fresh directory")
    return ckpt


# -- the file format ----------------------------------------------------------------------------

def _encode(step: int, params: np.ndarray, optimizer_state: dict, data_position: dict | int,
            rng_state: dict | None, meta: dict) -> bytes:
    """The whole file in memory: .npy members, a JSON manifest, and the checksum at the end."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    if not (isinstance(meta, dict) and isinstance(optimizer_state, dict)
            and all(isinstance(k, str) for k in optimizer_state)):
        raise ConfigError("meta and optimizer_state must be dicts with str keys, e.g. "
                          "meta={'config': cfg} and optimizer_state=opt.state_dict()")
    opt_arrays = {k: v for k, v in optimizer_state.items() if isinstance(v, np.ndarray)}
    arrays = {"params": params, **{f"optimizer/{k}": v for k, v in opt_arrays.items()}}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            raise ConfigError(f"{name} must be a numpy array of numbers, got {type(a).__name__} "
                              f"{getattr(a, 'dtype', '')}: a checkpoint stores no Python objects")
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": int(step),
        "optimizer_arrays": sorted(opt_arrays), "optimizer_values": _plain(
            {k: v for k, v in optimizer_state.items() if k not in opt_arrays}, "optimizer_state"),
        "data_position": _plain(data_position, "data_position"),
        "rng_state": _plain(rng_state, "rng_state"), "meta": _plain(meta, "meta"),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(zipfile.ZipInfo(_MANIFEST, _EPOCH), json.dumps(manifest, indent=1))
        for name, a in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(a), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(f"{name}.npy", _EPOCH), member.getvalue())
        zf.comment = b"0" * _DIGEST_LEN  # placeholder: the comment is the file's last bytes
    body = buf.getvalue()[:-_DIGEST_LEN]
    return body + hashlib.sha256(body).hexdigest().encode()


def _decode(path: Path, raw: bytes) -> Checkpoint:
    """Parse a file whose checksum has been verified; anything unexpected is a CheckpointError."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is unreadable ({why}): delete it or resume "
                               "from an earlier one")

    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            def member(name: str) -> bytes:
                if name not in zf.namelist():
                    raise bad(f"missing member {name}")
                return zf.read(name)

            m = json.loads(member(_MANIFEST))
            if not isinstance(m, dict) or m.get("format") != FORMAT:
                raise bad(f"not a {FORMAT} file")
            if m.get("version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint {path} has format version {m.get('version')!r}, this dplab reads "
                    f"version {FORMAT_VERSION}: load it with the dplab that wrote it, or start afresh")

            def array(name: str) -> np.ndarray:
                return np.lib.format.read_array(io.BytesIO(member(f"{name}.npy")), allow_pickle=False)

            params, opt = array("params"), _decode_json(m["optimizer_values"])
            opt.update({k: array(f"optimizer/{k}") for k in m["optimizer_arrays"]})
            return Checkpoint(path, int(m["step"]), params, opt, _decode_json(m["data_position"]),
                              _decode_json(m["rng_state"]), _decode_json(m["meta"]))
    except CheckpointError:
        raise
    except Exception as e:  # a verified file that still does not parse: refuse it, whatever broke
        raise bad(f"{type(e).__name__}: {e}") from e


def _plain(x: Any, where: str) -> Any:
    """``x`` as plain JSON values; numpy arrays become {"__ndarray__": dtype, "shape", "data"}."""
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x)
    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        return {"__ndarray__": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x), where)
    if isinstance(x, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        if bad := [k for k in x if not isinstance(k, str)]:
            raise ConfigError(f"{where} has the key {bad[0]!r}: checkpoint dicts need str keys "
                              "(JSON would silently turn it into a string)")
        return {k: _plain(v, f"{where}.{k}") for k, v in x.items()}
    raise ConfigError(f"{where} is a {type(x).__name__}, which a checkpoint cannot store: use "
                      "numbers, strings, None, lists, dicts with str keys or numpy arrays")


def _decode_json(x: Any) -> Any:
    """Inverse of ``_plain`` for what ``json.loads`` gives back (arrays restored, exact)."""
    if isinstance(x, dict) and "__ndarray__" in x:
        return np.array(x["data"], dtype=np.dtype(x["__ndarray__"])).reshape(x["shape"])
    if isinstance(x, dict):
        return {k: _decode_json(v) for k, v in x.items()}
    return [_decode_json(v) for v in x] if isinstance(x, list) else x


def _diff(a: Any, b: Any, where: str = "meta") -> list[tuple[str, Any, Any]]:
    """Paths where two decoded JSON values differ (NaN equals NaN; 1 equals 1.0)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys())
                for d in _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (u, v) in enumerate(zip(a, b)) for d in _diff(u, v, f"{where}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    else:
        same = type(a) is type(b) or {type(a), type(b)} <= {int, float}
        same = same and (a == b or (isinstance(a, float) and a != a and b != b))
    return [] if same else [(where, a, b)]


def _fsync_dir(directory: Path) -> None:
    """fsync the directory: on POSIX the rename is a change to the directory, not to the file."""
    if os.name == "posix":  # elsewhere a directory cannot be opened; the rename is still atomic
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
