"""One core's worth of work per rank: BLAS and torch run single-threaded in every rank.

A forked rank whose launcher had used torch ran a parallel torch kernel (DDP copying 8 MiB of
parameters) and waited forever in libgomp: the launcher's OpenMP pool does not survive the fork.
And ranks that each started a BLAS thread per core fought over the cores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import torch
from torch import nn
from dplab.backends import World
a = torch.randn(2048, 2048, dtype=torch.float64)
a @ a  # the launcher's OpenMP pool is now busy: a fork inherits it broken

def job(comm):
    from dplab.backends.nn.ddp import DDP
    layers = (nn.Linear(1024, 1024, bias=False, dtype=torch.float64) for _ in range(3))
    model = nn.Sequential(*layers)
    ddp = DDP(model, comm)  # broadcasts 24 MiB of parameters: parallel copies
    n = len(ddp.reducer.buckets)
    ddp.close()
    return n, torch.get_num_threads()

if __name__ == "__main__":
    with World(2, timeout=20) as world:
        print(world.run(job))
"""


@pytest.mark.torch
def test_launch_forked_ranks_run_torch_after_the_launcher_used_openmp(tmp_path):
    pytest.importorskip("torch", reason="needs torch: pip install 'dplab[torch]'")
    script = tmp_path / "omp.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(1, 1), (1, 1)]"


def _blas_threads(comm) -> int:
    import ctypes

    maps = open("/proc/self/maps").read().splitlines()
    path = next(line.split()[-1] for line in maps if "openblas" in line.lower())
    lib = ctypes.CDLL(path)
    get = next(
        getattr(lib, n)
        for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads")
        if hasattr(lib, n)
    )
    return get()


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_launch_ranks_run_blas_on_one_thread(backend):
    """p ranks with a BLAS thread per core each would fight over the cores."""
    import numpy as np

    from dplab.backends.launch.world import BackendUnavailable, check_backend, launch

    try:
        check_backend(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    np.ones((64, 64)) @ np.ones((64, 64))  # NumPy's OpenBLAS is loaded (and threaded) here
    if not any("openblas" in line.lower() for line in open("/proc/self/maps")):
        pytest.skip("this NumPy does not use OpenBLAS")
    assert launch(_blas_threads, 2, backend=backend) == [1, 1]


DYNAMO = """
import sys
import torch
from dplab.backends import launch

def job(comm):
    before = "torch._dynamo" in sys.modules
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # torch.optim imports torch._dynamo at a first step
    return before, "torch._dynamo" in sys.modules

if __name__ == "__main__":
    print(launch(job, 2))
"""


@pytest.mark.torch
def test_forked_ranks_of_a_torch_launcher_inherit_what_a_first_optimizer_step_imports(tmp_path):
    """Each rank imported torch._dynamo at its first optimizer step (about 2 CPU-s a rank); a
    launcher that uses torch imports it once before it forks."""
    pytest.importorskip("torch", reason="needs torch: pip install 'dplab[torch]'")
    script = tmp_path / "dynamo.py"
    script.write_text(DYNAMO)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(True, True), (True, True)]"


def _import_value(comm, name: str):
    import importlib
    import signal

    signal.alarm(20)  # a rank that waits for the module's lock for good dies, and says so
    value = importlib.import_module(name).VALUE
    signal.alarm(0)
    return value


def test_a_rank_forked_while_another_thread_imports_a_module_imports_it_too(tmp_path,
                                                                           monkeypatch):
    """An app server's or a notebook's other thread was importing a module when a world forked:
    the module's lock stayed taken in the ranks for good, and a rank importing it waited without
    end (Python re-makes only its global import lock after a fork)."""
    import threading
    import time

    from dplab.backends import launch

    name = f"dplab_slow_import_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("import time\ntime.sleep(2)\nVALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importing = threading.Thread(target=__import__, args=(name,))
    importing.start()
    deadline = time.monotonic() + 30
    while name not in sys.modules and time.monotonic() < deadline:  # its import under way
        time.sleep(0.01)
    try:
        assert launch(_import_value, 2, args=(name,)) == [42, 42]
    finally:
        importing.join()
        sys.modules.pop(name, None)


def _frozen(comm) -> int:
    import gc

    return gc.get_freeze_count()


def test_ranks_leave_what_they_inherited_to_the_launcher_and_the_launcher_collects_again():
    """A forked rank's collector skips the launcher's objects (walking them would copy every page
    they sit on), and the launcher itself is not left frozen: its garbage is still collected."""
    import gc

    from dplab.backends import launch

    frozen = launch(_frozen, 2)
    assert all(n > 1000 for n in frozen), f"the ranks' collector walks all they inherited: {frozen}"
    assert gc.get_freeze_count() == 0, "the launcher stayed frozen: its cycles are never collected"
