"""A full /dev/shm: one line that names it and how much was needed, exit 2, nothing left behind.

Each case runs ``dplab`` in a mount namespace of its own with a small tmpfs over /dev/shm
(``unshare -m``, root only), so the machine's /dev/shm and other jobs never see it, and what is
left in that tmpfs afterwards is exactly what the run leaked.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) to mount a small /dev/shm of its "
                                       "own")

DPLAB = str(Path(sys.executable).with_name("dplab"))


def _dplab_in_small_shm(size: str, *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stderr, what is left in /dev/shm) of ``dplab argv`` over a ``size`` tmpfs."""
    script = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; "
              f"{shlex.join([DPLAB, *argv])} >/dev/null 2>/tmp/.dplab_err_$$; rc=$?; "
              "cat /tmp/.dplab_err_$$ >&2; rm -f /tmp/.dplab_err_$$; ls -A /dev/shm; exit $rc")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120
    )
    if done.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return done.returncode, done.stderr.strip(), done.stdout.split()


@pytest.mark.parametrize("size", [
    "16k",  # not even the launcher's mailboxes fit
    "64k",  # the mailboxes fit, multiprocessing's semaphores do not
    "2m",  # the launcher's part fits; a rank's first buffer does not (was a SIGBUS)
])
def test_local_train_says_dev_shm_is_full_in_one_line(size):
    """Since issue 28 the world's /dev/shm is estimated before the first rank starts
    (``launch/limits.py``): each of these is refused there, with what is needed and free."""
    rc, err, left = _dplab_in_small_shm(size, "train", "--world-size", "4", "--steps", "2")
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "of /dev/shm (the ranks' semaphores" in err, err
    assert "is free" in err and "too much" in err and "Traceback" not in err
    assert left == []


def test_mpi_says_dev_shm_is_full_before_mpich_starts():
    pytest.importorskip("mpi4py")
    rc, err, left = _dplab_in_small_shm("1m", "train", "--backend", "mpi", "--world-size", "2",
                                         "--steps", "2")
    assert rc == 2, err
    assert err.count("\n") == 0 and "MPICH's shared memory of 2 ranks" in err, err
    assert left == []
