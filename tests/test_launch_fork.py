"""Forked ranks after the launcher used torch: its OpenMP pool does not survive the fork.

A rank that then ran a parallel torch kernel (DDP copying 8 MiB of parameters) waited forever
in libgomp. Forked ranks now run torch single-threaded, one core's worth of work each.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs torch: pip install 'dplab[torch]'")

SCRIPT = """
import torch
from torch import nn
from dplab.backends import World
a = torch.randn(2048, 2048, dtype=torch.float64)
a @ a  # the launcher's OpenMP pool is now busy: a fork inherits it broken

def job(comm):
    from dplab.backends.nn.ddp import DDP
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False, dtype=torch.float64) for _ in range(3)))
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
    script = tmp_path / "omp.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(1, 1), (1, 1)]"
