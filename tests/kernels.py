"""One arithmetic on every x86-64 machine: the kernels the tests pin before NumPy loads.

    import kernels; kernels.pin()    # before anything imports NumPy (tests/conftest.py does)

The recorded bits (tests/golden) and the README's sample depend on which kernels do the
arithmetic: OpenBLAS picks its matrix multiply by CPU (SkylakeX where there is AVX-512, Haswell
where there is AVX2) and NumPy sends exp and log to AVX-512 code where it can; each rounds
differently. Pinned to the AVX2 kernels, which any x86-64 CPU with AVX2 runs, a recorded bit moves
only when the code does. The processes the tests start inherit the pin. Set either variable
yourself to run the tests on other kernels.
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["KERNELS", "cpu_flags", "has_avx2", "pin"]

# NumPy's dispatch targets as NumPy 2.4 names them: an older NumPy warns of names it does not
# dispatch to (and its bits may differ from the recorded ones anyway)
KERNELS = {"OPENBLAS_CORETYPE": "Haswell",
           "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"}


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (none where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def has_avx2() -> bool:
    """Whether this CPU runs the AVX2 kernels (x86-64 with AVX2 and FMA)."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags()


def pin() -> None:
    """Pin NumPy and OpenBLAS to the AVX2 kernels in this process and its children, where the CPU
    has them; a variable already set stays as set.

    Raises:
        RuntimeError: NumPy is already loaded, so its kernels are chosen.
    """
    if not has_avx2():
        return
    if "numpy" in sys.modules:
        raise RuntimeError("NumPy was loaded before its kernels could be pinned: call pin() first")
    for name, value in KERNELS.items():
        os.environ.setdefault(name, value)
