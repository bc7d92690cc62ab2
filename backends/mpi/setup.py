"""Before an MPI world starts: are mpi4py and an ``mpiexec`` there. Its ranks are started by
mpiexec (``mpiexec.py``), not forked, so there is nothing to prepare in the launcher."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["available"]


def available() -> str | None:
    """None when the MPI backend can run here, otherwise what to install."""
    try:
        import mpi4py  # noqa: F401  (the package only: importing mpi4py.MPI would start MPI)
    except ImportError:
        return "mpi4py is not installed: pip install 'dplab[mpi]' (mpi4py + the mpich wheel)"
    if not (Path(sys.executable).parent / "mpiexec").exists() and not shutil.which("mpiexec"):
        return "no mpiexec beside python or on PATH: pip install 'dplab[mpi]' (the mpich wheel)"
    return None
