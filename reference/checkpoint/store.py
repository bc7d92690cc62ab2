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

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import zipfile
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np

from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.files import WriteError, open_regular, size_text, write_atomic

__all__ = ["CheckpointError", "Checkpoint", "Listing", "Bounds", "FORMAT", "FORMAT_VERSION",
           "MAX_MEMBERS", "save_checkpoint", "load_checkpoint", "list_checkpoints"]

FORMAT, FORMAT_VERSION = "dplab-checkpoint", 1
_NAME = re.compile(r"ckpt-(\d{8,})\.npz")  # complete checkpoints; temporaries start with "."
_DIGEST_LEN = 64  # hex SHA-256, stored as the zip's archive comment: the file's last bytes
_MANIFEST = "manifest.json"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: the same state gives the same bytes
MAX_MEMBERS = 16  # the parameters, the optimizer's arrays and the manifest: dplab writes no more
_NPY_HEADER = 4096  # a .npy header of one array, with room to spare (numpy pads it to 64 bytes)
_ZIP_ENTRY = 1024  # a member's local and central zip headers: names are short
_PIECE = 1 << 20  # the checksum reads the file in pieces this large
_UNBOUNDED = 1 << 62  # no bounds given: the file system's own limit
log = logging.getLogger(__name__)


class CheckpointError(DplabError):
    """A checkpoint that must not be resumed from; the message says what to do instead."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint. Its arrays are fresh copies that belong to the caller.

    Args:
        path: the file it came from.
        step: its step.
        params: the parameters.
        optimizer_state: the optimizer's state.
        data_position: where the run was.
        rng_state: a random generator's state, or None.
        meta: the run's metadata.
    """

    path: Path
    step: int
    params: np.ndarray
    optimizer_state: dict[str, np.ndarray | int]
    data_position: dict | int
    rng_state: dict | None
    meta: dict


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a checkpoint directory holds.

    Args:
        checkpoints: complete checkpoints, lowest step first.
        strays: temporaries of saves that never finished.
    """

    checkpoints: tuple[Path, ...]  # complete checkpoints, lowest step first
    strays: tuple[Path, ...]  # temporaries of saves that never finished: ignored, safe to delete

    @property
    def latest(self) -> Path | None:
        """The highest-step complete checkpoint, or None.

        Returns:
            Its path, or None when there is none.
        """
        return self.checkpoints[-1] if self.checkpoints else None


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The most one run's checkpoint can hold: each array at most ``array_bytes`` (the parameters,
    n x itemsize; optimizer states are the same size), the JSON manifest at most ``manifest_bytes``
    (meta, the data position, the parameter server's log). ``load_checkpoint`` checks the file's
    size and every member's against them before reading.

    Args:
        array_bytes: the most bytes of one array.
        manifest_bytes: the most bytes of the JSON manifest.
    """

    array_bytes: int
    manifest_bytes: int

    def file_bytes(self) -> int:
        """The largest checkpoint file these bounds allow (every member at its largest).

        Returns:
            Bytes.
        """
        members = (MAX_MEMBERS - 1) * (self.array_bytes + _NPY_HEADER + _ZIP_ENTRY)
        return members + self.manifest_bytes + _ZIP_ENTRY + _DIGEST_LEN


def list_checkpoints(directory: str | os.PathLike) -> Listing:
    """The complete checkpoints of ``directory`` by step, and the stray temporaries beside them.

    Args:
        directory: a checkpoint directory (missing: nothing in it).

    Returns:
        The checkpoints in step order, and the strays.
    """
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

    Args:
        directory: where to write (created if missing).
        step: the step, in the file's name.
        params: the parameters.
        optimizer_state: the optimizer's ``state_dict()``.
        data_position: where the run is.
        rng_state: a random generator's state, or None.
        meta: the run's metadata, compared on load.
        keep_last: how many checkpoints to keep, or None for all.

    Returns:
        The path written.

    Raises:
        ConfigError: a value a checkpoint cannot store, before anything is written.
        WriteError: the directory cannot take the file (full, read-only, not a directory); the
            checkpoints already there are untouched.
    """
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    data = _encode(step, params, optimizer_state, data_position, rng_state, meta)  # checks first
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, full, or a link to nowhere where the directory should be
        raise WriteError(f"checkpoint directory {d}: cannot create it ({e.strerror or e}): choose "
                         "another --checkpoint-dir") from None
    final = write_atomic(d / f"ckpt-{step:08d}.npz", data, what="checkpoint")  # temp, fsync, rename
    try:
        _fsync_dir(d)
        if keep_last is not None:
            for old in list_checkpoints(d).checkpoints[:-keep_last]:
                if old != final:
                    old.unlink(missing_ok=True)
    except OSError as e:
        raise WriteError(f"checkpoint directory {d}: {e.strerror or e} after writing {final.name}: "
                         "check the directory") from None
    return final


def load_checkpoint(path: str | os.PathLike, *, expect_meta: dict | None = None,
                    bounds: Bounds | None = None) -> Checkpoint:
    """Load a checkpoint file, or the latest complete one of a directory, verified whole.

    ``expect_meta``: the metadata this run would write; a checkpoint whose metadata differs
    is refused with an error naming the differing fields. ``bounds``: the most this run's
    checkpoint can hold; a file or a member larger than that is refused before it is read.
    Only a regular file is read, in pieces (a FIFO, a device or a link to one is refused), and
    only uncompressed members (what ``save_checkpoint`` writes): memory stays within the file's
    size.

    Args:
        path: a checkpoint file, or a directory of them.
        expect_meta: the metadata this run would write, or None not to compare.
        bounds: the most this run's checkpoint can hold, or None for no bound.

    Returns:
        The checkpoint's arrays, states, metadata and path.

    Raises:
        CheckpointError: in one line, why this file must not be resumed from.
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
    limit = _UNBOUNDED if bounds is None else bounds.file_bytes()
    try:
        with open_regular(p, limit, "checkpoint") as f:
            if not _checksum_ok(f):
                raise CheckpointError(f"checkpoint {p} is corrupt (checksum mismatch: truncated or "
                                      "altered): delete it or resume from an earlier one")
            ckpt = _decode(p, f, bounds or Bounds(_UNBOUNDED, _UNBOUNDED))
    except OSError as e:  # the file changed or vanished under us
        raise CheckpointError(f"cannot read checkpoint {p} ({e.strerror or e}): "
                              "check the path") from None
    except CheckpointError:
        raise
    except ConfigError as e:  # open_regular's: not a regular file, or too large for this run
        raise CheckpointError(str(e)) from None
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


def _checksum_ok(f: BinaryIO) -> bool:
    """Do the last 64 bytes of ``f`` hold the SHA-256 of the rest? Read in pieces, not whole."""
    size = os.fstat(f.fileno()).st_size
    if size <= _DIGEST_LEN:
        return False
    h, left = hashlib.sha256(), size - _DIGEST_LEN
    while left > 0:
        piece = f.read(min(left, _PIECE))
        if not piece:
            return False
        h.update(piece)
        left -= len(piece)
    return h.hexdigest().encode() == f.read(_DIGEST_LEN)


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


def _decode(path: Path, f: BinaryIO, bounds: Bounds) -> Checkpoint:
    """Parse a file whose checksum has been verified; anything unexpected is a CheckpointError.
    Every member's size is checked against ``bounds`` before it is read."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is unreadable ({why}): delete it or resume "
                               "from an earlier one")

    try:
        f.seek(0)
        with zipfile.ZipFile(f) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            if len(infos) > MAX_MEMBERS:
                raise bad(f"{len(infos)} members; dplab writes at most {MAX_MEMBERS}")
            for name, info in infos.items():
                cap = bounds.manifest_bytes if name == _MANIFEST else \
                    bounds.array_bytes + _NPY_HEADER
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                    raise bad(f"member {name} is compressed; dplab stores members as they are")
                if info.file_size > cap:
                    raise bad(f"member {name} holds {size_text(info.file_size)}, more than "
                              f"this run's model can fill ({size_text(cap)})")

            def member(name: str) -> bytes:
                if name not in infos:
                    raise bad(f"missing member {name}")
                return zf.read(name)

            m = json.loads(member(_MANIFEST))
            if not isinstance(m, dict) or m.get("format") != FORMAT:
                raise bad(f"not a {FORMAT} file")
            if m.get("version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint {path} has format version {m.get('version')!r}, this dplab reads "
                    f"version {FORMAT_VERSION}: load it with the dplab that wrote it, or start "
                    "afresh")

            def array(name: str) -> np.ndarray:
                if f"{name}.npy" not in infos:
                    raise bad(f"missing member {name}.npy")
                with zf.open(f"{name}.npy") as a:
                    return _read_npy(a, infos[f"{name}.npy"].file_size, bad)

            params, opt = array("params"), _decode_json(m["optimizer_values"])
            opt.update({k: array(f"optimizer/{k}") for k in m["optimizer_arrays"]})
            return Checkpoint(path, int(m["step"]), params, opt, _decode_json(m["data_position"]),
                              _decode_json(m["rng_state"]), _decode_json(m["meta"]))
    except CheckpointError:
        raise
    except Exception as e:  # a verified file that still does not parse: refuse it, whatever broke
        raise bad(f"{type(e).__name__}: {e}") from e


def _read_npy(f: IO[bytes], size: int, bad: Any) -> np.ndarray:
    """One .npy member of ``size`` bytes: its header must describe exactly the bytes that follow
    (a header claiming 10^12 elements would otherwise be allocated before the data runs out)."""
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
        np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    if dtype.hasobject:
        raise bad("an object array: it would need pickle, which a checkpoint never holds")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != size - f.tell():
        raise bad(f"an array header of {list(shape)} {dtype} over {size - f.tell()} bytes of data")
    buf = bytearray(nbytes)
    if f.readinto(buf) != nbytes:
        raise bad("an array cut short")
    a = np.frombuffer(buf, dtype)
    return a.reshape(shape[::-1]).transpose() if fortran else a.reshape(shape)


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
