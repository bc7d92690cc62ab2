"""A fresh rank's first collective builds its schedule; that must not pull in numpy.ma (np.unique
imports it lazily: 17 ms on a quiet machine, 0.5 s on a loaded one, paid by every fresh rank)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from dplab.reference.algorithms import ALLREDUCE
for name in ALLREDUCE:
    ALLREDUCE[name](5)
print("numpy.ma" in sys.modules)
"""


def test_building_every_schedule_leaves_numpy_ma_unimported():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
