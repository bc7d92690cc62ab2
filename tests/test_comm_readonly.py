"""Read-only buffers are refused up front, on every backend, by every collective.

A collective works in place, so a read-only array (``np.frombuffer(bytes)``, a broadcast
view, ``a.setflags(write=False)``) cannot hold its result. Refused before the first message,
on every rank alike, the error is a ``ConfigError`` that says what to pass instead; found
mid-collective it was a raw ValueError on one rank (local, MPI) while its peers waited out the
timeout, and torch wrote straight into memory numpy had promised not to change.
"""

from __future__ import annotations

import numpy as np

from dplab.reference import collectives
from dplab.reference.errors import ConfigError

CALLS = (
    "allreduce-ring",
    "allreduce-tree",
    "allreduce-native",
    "native_allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
)


def job_readonly(comm, how):
    """Every collective on a read-only buffer: (call, error type, is ConfigError, message,
    untouched)."""
    out = []
    for call in CALLS:
        raw = bytes(range(1, 33))  # 4 float64 over immutable bytes
        buf = np.frombuffer(raw, np.float64) if how == "bytes" else np.ones(4)
        if how == "flag":
            buf.setflags(write=False)
        before = buf.tobytes()
        kind, _, algorithm = call.partition("-")
        try:
            if kind == "native_allreduce":
                comm.native_allreduce(buf)
            elif kind == "allreduce":
                collectives.allreduce(comm, buf, algorithm=algorithm)
            else:
                getattr(collectives, kind)(comm, buf)
        except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
            out.append(
                (
                    call,
                    type(e).__name__,
                    isinstance(e, ConfigError),
                    str(e),
                    buf.tobytes() == before,
                )
            )
        else:
            out.append((call, None, False, "", buf.tobytes() == before))
    return out


def test_read_only_buffers_are_refused_by_every_collective_on_every_backend(worlds, backend):
    for how in ("bytes", "flag"):
        for rank, rows in enumerate(worlds(2, backend).run(job_readonly, how)):
            for call, name, is_config_error, message, untouched in rows:
                assert is_config_error, f"{backend} {how} rank {rank} {call}: got {name}: {message}"
                assert "read-only" in message and ".copy()" in message, message
                assert untouched, (
                    f"{backend} {how} rank {rank} {call} wrote into a read-only buffer"
                )


def job_still_works_after_refusal(comm):
    """A refusal consumed no message: the next collective on a writable buffer is exact."""
    try:
        collectives.allreduce(comm, np.frombuffer(b"\0" * 32, np.float64))
    except ConfigError:
        pass
    buf = np.full(5, comm.rank + 1.0)
    return collectives.allreduce(comm, buf, "ring").tolist()


def test_a_refused_collective_leaves_the_world_usable(worlds, backend):
    assert worlds(3, backend).run(job_still_works_after_refusal) == [[6.0] * 5] * 3
