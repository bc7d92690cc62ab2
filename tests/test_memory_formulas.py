"""The ZeRO memory closed forms: hand-computed values, the paper's Figure 1, the docstring's
numbers."""

from __future__ import annotations

import doctest
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dplab.reference.errors import ConfigError
from dplab.reference.zero import memory
from dplab.reference.zero.memory import (
    GB,
    PRECISIONS,
    MemoryBreakdown,
    PrecisionBytes,
    model_state_bytes,
    state_bytes_per_param,
)

# ZeRO (Rajbhandari et al. 2020), Figure 1, GB per rank
PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def test_the_papers_figure_1():
    """Psi = 7.5B, N = 64, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB per rank."""
    k = state_bytes_per_param("adam", "mixed")
    assert k == 12
    for stage, gb in PAPER.items():
        assert round(model_state_bytes(7.5e9, stage, 64, state_bytes=k).total / GB, 1) == gb
    exact = [model_state_bytes(7.5e9, s, 64).total for s in range(4)]
    assert exact == [120e9, 31.40625e9, 16.640625e9, 1.875e9]


def test_hand_computed_breakdowns():
    """Psi = 1000, N = 4, P = G = 2, K = 12: each stage divides the right terms by 4, no others."""
    assert model_state_bytes(1000, 0, 4) == MemoryBreakdown(2000, 2000, 12000)
    assert model_state_bytes(1000, 1, 4) == MemoryBreakdown(2000, 2000, 3000)
    assert model_state_bytes(1000, 2, 4) == MemoryBreakdown(2000, 500, 3000)
    assert model_state_bytes(1000, 3, 4) == MemoryBreakdown(500, 500, 3000)
    assert model_state_bytes(1000, 3, 4).total == 4000
    # float32 Adam (P = G = 4, K = 8), 10 params on 3 ranks: Psi/N is not whole
    b = model_state_bytes(10, 2, 3, param_bytes=4, grad_bytes=4, state_bytes=8)
    assert (b.params, b.grads, b.optimizer) == (40, pytest.approx(40 / 3), pytest.approx(80 / 3))


def test_the_seven_billion_example():
    """The issue's example: 7B in fp16 is 14 GB of weights; mixed Adam 16 B/param is 112 GB."""
    b = model_state_bytes(7e9, 0, 1)
    assert (b.params / GB, b.total / GB) == (14.0, 112.0)
    assert model_state_bytes(7e9, 3, 8).total / GB == 14.0


@pytest.mark.parametrize(("optimizer", "precision", "k"), [
    ("sgd", "float64", 0), ("momentum", "float64", 8), ("adam", "float64", 16),
    ("sgd", "float32", 0), ("momentum", "float32", 4), ("adam", "float32", 8),
    ("sgd", "mixed", 4), ("momentum", "mixed", 8), ("adam", "mixed", 12),
    ("lars", "mixed", 8), ("lamb", "mixed", 12), ("adam", "bf16-mixed", 12), ("lamb", "float32", 8),
])
def test_state_bytes_per_param(optimizer, precision, k):
    assert state_bytes_per_param(optimizer, precision) == k


def test_precision_table_is_frozen_and_mixed_is_the_papers():
    assert PRECISIONS["mixed"] == PrecisionBytes(
        param_bytes=2, grad_bytes=2, master_bytes=4, moment_bytes=4
    )
    assert PRECISIONS["float64"].master_bytes == 0
    with pytest.raises(AttributeError):
        PRECISIONS["mixed"].param_bytes = 4  # type: ignore[misc]


@given(psi=st.integers(0, 10**13), n=st.integers(1, 4096), p=st.integers(0, 8), g=st.integers(0, 8),
       k=st.integers(0, 24))
def test_stages_only_ever_shrink_and_stage_3_is_stage_0_over_n(psi, n, p, g, k):
    bytes_ = {"param_bytes": p, "grad_bytes": g, "state_bytes": k}
    totals = [model_state_bytes(psi, s, n, **bytes_).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    assert totals[3] == pytest.approx(totals[0] / n, rel=1e-12)
    one = [model_state_bytes(psi, s, 1, **bytes_) for s in range(4)]
    assert all(b == one[0] for b in one)  # one rank: nothing to shard over


def test_numpy_counts_are_numbers_too():
    """A parameter count summed by NumPy (np.int64) or a world size from an array is accepted."""
    import numpy as np

    assert model_state_bytes(np.int64(1000), 2, np.int64(4)) == MemoryBreakdown(2000, 500, 3000)
    assert model_state_bytes(np.float32(1000), 0, 1, state_bytes=np.int64(8)).total == 12000


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"stage": 4}, "stage must be 0, 1, 2 or 3"),
    ({"stage": True}, "stage must be 0, 1, 2 or 3"),
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 2.0}, "world_size must be an integer"),
    ({"num_params": -1}, "num_params must be a finite number >= 0"),
    ({"num_params": float("nan")}, "num_params"),
    ({"state_bytes": float("inf")}, "state_bytes"),
    ({"num_params": "7B"}, "num_params must be a finite number"),
    ({"world_size": True}, "world_size must be an integer"),
])
def test_bad_arguments_say_what_to_do(kwargs, match):
    args = {"num_params": 100, "stage": 1, "world_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        model_state_bytes(args.pop("num_params"), args.pop("stage"), args.pop("world_size"), **args)


def test_unknown_optimizer_or_precision():
    with pytest.raises(
        ConfigError, match="optimizer must be one of sgd, momentum, adam, lars, lamb"
    ):
        state_bytes_per_param("adagrad", "mixed")
    with pytest.raises(ConfigError, match="precision must be one of float64, float32, mixed, "
                                          "bf16-mixed"):
        state_bytes_per_param("adam", "fp8")


def test_the_docstring_example_is_the_code():
    """The worked example in the module docstring: its numbers are what the code computes."""
    assert doctest.testmod(memory).failed == 0
    rows = re.findall(r"stage (\d)\s+.*=\s+([\d.]+)\s+GB", memory.__doc__)
    assert [int(s) for s, _ in rows] == [0, 1, 2, 3]
    for stage, gb in rows:
        assert round(model_state_bytes(7.5e9, int(stage), 64).total / GB, 1) == float(gb)
