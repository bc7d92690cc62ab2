"""auto goes by what ``dplab tune`` measured at a benchmarked size, and by the fit in between.

A fit of alpha, beta, gamma to a loaded machine's rows missed them by 12-60% (``dplab tune``, two
shared cores): enough for auto to rank schedules 2x apart the wrong way round, e.g. a ring over
MPICH's own all-reduce at 64 KiB. The tune file now keeps the measured cells, and each candidate's
fitted time is scaled by measured / fitted at the nearest measured size of its own cell.
"""

from __future__ import annotations

import json

import pytest

from dplab.reference import auto
from dplab.reference.costfit import CostFit


def row(alg: str, p: int, nbytes: int, us: float) -> dict:
    return {"backend": "mpi", "algorithm": alg, "world_size": p, "bytes": nbytes, "time_us": us}


def fits_that_misprice() -> tuple[CostFit, ...]:
    """ring's fit says 10 us + 1 GB/s-ish, native's says far slower; the measurements say the
    opposite at 64 KiB and 1 MiB (native 20 / 300 us, ring 80 / 900 us)."""
    return (
        CostFit(
            "mpi",
            2,
            "ring",
            1e-6,
            1e-12,
            None,
            (row("ring", 2, 1 << 16, 80), row("ring", 2, 1 << 20, 900)),
        ),
        CostFit(
            "mpi",
            2,
            "native",
            5e-4,
            1e-9,
            None,
            (
                row("native", 2, 4096, 6),
                row("native", 2, 1 << 16, 20),
                row("native", 2, 1 << 20, 300),
            ),
        ),
    )


def test_a_measured_size_is_priced_at_its_measurement_and_auto_follows_it():
    t = auto.Tuning(fits_that_misprice(), "test")
    plain = auto.Tuning(fits_that_misprice(), "test", measured=())  # the fit alone, as before
    assert plain.choose("mpi", 2, 1 << 16) == "ring"  # the fit's mistake
    assert t.predict_s("mpi", "ring", 2, 1 << 16) == pytest.approx(80e-6)
    # native at a measured size: its measurement plus the shape check (32 bytes: the fit's shape
    # scaled at the nearest measured size, 4 KiB's 6 us)
    assert t.predict_s("mpi", "native", 2, 1 << 16) == pytest.approx(20e-6 + 6e-6, rel=0.01)
    assert t.choose("mpi", 2, 1 << 16) == "native" and t.choose("mpi", 2, 1 << 20) == "native"
    # between measured sizes the fit's shape, scaled at the nearest (by ratio) measured size
    fit = fits_that_misprice()[0]
    at = 3 << 18  # 768 KiB: nearer 1 MiB than 64 KiB
    expected = fit.predict_s("ring", 2, at) * 900e-6 / fit.predict_s("ring", 2, 1 << 20)
    assert t.predict_s("mpi", "ring", 2, at) == pytest.approx(expected)


def test_the_measured_cells_survive_the_tune_file_and_old_files_keep_the_fit(tmp_path):
    path = auto.save_tuning(auto.Tuning(fits_that_misprice(), "test"), tmp_path / "tune.json")
    data = json.loads(path.read_text())
    assert ["mpi", 2, "native", 1 << 16, pytest.approx(20e-6)] in data["measured"]
    back = auto.load_tuning(path)
    assert len(back.measured) == 5 and back.choose("mpi", 2, 1 << 16) == "native"
    del data["measured"]  # a file from before: the fit alone
    path.write_text(json.dumps(data))
    old = auto.load_tuning(path)
    assert old.measured == () and old.choose("mpi", 2, 1 << 16) == "ring"
    data["measured"] = [["mpi", 2, "ring"]]
    path.write_text(json.dumps(data))
    with pytest.raises(auto.ConfigError, match="dplab tune"):
        auto.load_tuning(path)
