"""Half-precision collectives on every backend: the accumulation rule and its error bound.

The rule (``dplab.reference.collectives``): every partial sum is rounded to the buffer's dtype,
so a float16 sum over p ranks carries up to p-1 roundings, and its error is at most
``gamma(p-1) * sum_r |x_r|`` per element, gamma(k) = k u / (1 - k u), u = 2**-11 (bfloat16: 2**-8).
Each rank's input is drawn from (seed, rank), so the test knows the exact float64 sum.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiers import engines

from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference import collectives
from dplab.reference.schedule import chunk_bounds

U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # unit roundoff
N = 1001  # odd: chunks of unequal length


def gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def rank_data(seed: int, rank: int, n: int = N) -> np.ndarray:
    """float16 values of both signs spanning several binades (exactly representable inputs)."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(n) * 2.0 ** rng.integers(-6, 7, n)).astype(np.float16)


def exact(p: int, seed: int, n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 sum of the float16 inputs, the float64 sum of their magnitudes)."""
    xs = [rank_data(seed, r, n).astype(np.float64) for r in range(p)]
    return sum(xs), sum(np.abs(x) for x in xs)


# -- what runs on the ranks (module level: pickled to the persistent worlds) ----------------

def job_half(comm, kind: str, algorithm: str, seed: int, op: str = "sum"):
    buf = comm.empty(N, "float16")
    buf[:] = rank_data(seed, comm.rank)
    if kind == "allreduce":
        collectives.allreduce(comm, buf, algorithm, op)
    elif kind == "reduce_scatter":
        collectives.reduce_scatter(comm, buf, algorithm)
    elif kind == "allgather":
        a, b = chunk_bounds(N, comm.world_size)[comm.rank]
        buf[:] = np.float16(-7)
        buf[a:b] = rank_data(seed, comm.rank)[a:b]
        collectives.allgather(comm, buf, algorithm)
    elif kind == "broadcast":
        if comm.rank != 1:
            buf[:] = np.float16(-7)
        collectives.broadcast(comm, buf, root=1, algorithm=algorithm)
    else:
        collectives.reduce(comm, buf, root=1, algorithm=algorithm)
    return np.array(buf, copy=True)


def job_values(comm, values: list[float], dtype: str, algorithm: str) -> list[float]:
    """Rank r contributes ``values[r]`` in every element."""
    buf = comm.empty(3, dtype)
    buf[:] = values[comm.rank]
    collectives.allreduce(comm, buf, algorithm)
    return buf.astype(np.float64).tolist()


def job_bfloat16(comm, seed: int, algorithm: str) -> tuple[list[float], str]:
    import torch

    t = torch.from_numpy(rank_data(seed, comm.rank).astype(np.float32)).to(torch.bfloat16)
    collectives.allreduce(comm, t, algorithm)
    return t.to(torch.float64).tolist(), str(t.dtype)


def job_refused(comm, what: str) -> tuple[str, str]:
    try:
        if what == "torch-on-numpy-backend":
            import torch

            collectives.allreduce(comm, torch.ones(4, dtype=torch.bfloat16))
        else:
            collectives.allreduce(comm, np.zeros(4, np.complex64))
    except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
        return type(e).__name__, str(e)
    return "", ""


# -- the tests -------------------------------------------------------------------------------

def assert_within_rule(
    got: np.ndarray, p: int, seed: int, extra_roundings: int = 0, label: str = "", times: int = 1
) -> None:
    """``got * times`` is the float64 sum to within the rule's bound (``times=p`` for a mean)."""
    total, magnitude = exact(p, seed)
    bound = gamma(p - 1 + extra_roundings, U["float16"]) * magnitude
    err = np.abs(got.astype(np.float64) * times - total)
    assert got.dtype == np.float16, label
    assert np.all(err <= bound), (
        f"{label}: worst error / bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"
    )


# every p on local; other engines at p = 3, the rest slow (a world start each: tiers.py)
@pytest.mark.parametrize("backend, p", engines([2, 3, 4]), indirect=["backend"])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "direct", "native"])
def test_float16_allreduce_within_the_stated_bound(worlds, backend, algorithm, p):
    seed = 11 * p
    outs = worlds(p, backend).run(job_half, "allreduce", algorithm, seed)
    for rank, out in enumerate(outs):
        assert_within_rule(out, p, seed, label=f"{backend} {algorithm} p={p} rank {rank}")
        assert out.tobytes() == outs[0].tobytes(), f"rank {rank} differs from rank 0"
    mean = worlds(p, backend).run(job_half, "allreduce", algorithm, seed, "mean")[0]
    assert_within_rule(mean, p, seed, extra_roundings=1, label=f"{algorithm} mean", times=p)


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_float16_reduce_scatter_and_allgather(worlds, backend, algorithm):
    p, seed = 3, 5
    for rank, out in enumerate(worlds(p, backend).run(job_half, "reduce_scatter", algorithm, seed)):
        a, b = chunk_bounds(N, p)[rank]
        total, magnitude = exact(p, seed)
        assert np.all(np.abs(out[a:b] - total[a:b]) <= gamma(p - 1, U["float16"]) * magnitude[a:b])
    full = np.concatenate([rank_data(seed, r)[slice(*chunk_bounds(N, p)[r])] for r in range(p)])
    for out in worlds(p, backend).run(job_half, "allgather", algorithm, seed):
        assert out.tobytes() == full.tobytes()  # copies: exact


@pytest.mark.parametrize("algorithm", ["tree", "naive"])
def test_float16_broadcast_and_reduce(worlds, backend, algorithm):
    p, seed = 4, 9
    for out in worlds(p, backend).run(job_half, "broadcast", algorithm, seed):
        assert out.tobytes() == rank_data(seed, 1).tobytes()
    out = worlds(p, backend).run(job_half, "reduce", algorithm, seed)[1]
    assert_within_rule(out, p, seed, label=f"reduce {algorithm}")


def test_every_partial_sum_is_rounded_to_float16(worlds, backend):
    """1 + 2**-11 rounds to 1 (a tie, to even) while 2**-11 + 2**-11 is exact: the element whose
    sum starts at rank 0 ends at 1.0, one that adds the small ones first at 1 + 2**-10. A float32
    accumulator would give 1 + 2**-10 everywhere."""
    u = 2.0**-11
    outs = worlds(3, backend).run(job_values, [1.0, u, u], "float16", "ring")
    assert outs[0] == outs[1] == outs[2]
    assert set(outs[0]) <= {1.0, 1.0 + 2 * u}
    assert 1.0 in outs[0], "ring adds rank 0's 1.0 first somewhere: that element must round"


@pytest.mark.parametrize("algorithm", ["ring", "tree", "native"])
def test_float16_overflow_is_inf_on_every_rank(worlds, backend, algorithm):
    outs = worlds(2, backend).run(job_values, [60000.0, 10000.0], "float16", algorithm)
    assert outs == [[np.inf] * 3] * 2  # 70000 > 65504, the largest float16


@pytest.mark.torch
@pytest.mark.parametrize("algorithm", ["ring", "tree", "native"])
def test_bfloat16_tensors_on_the_torch_backend(worlds, algorithm):
    try:
        check_backend("torch")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    import torch

    p, seed = 3, 4
    xs = [
        torch.from_numpy(rank_data(seed, r).astype(np.float32)).to(torch.bfloat16).double().numpy()
        for r in range(p)
    ]
    total, magnitude = sum(xs), sum(np.abs(x) for x in xs)
    outs = worlds(p, "torch").run(job_bfloat16, seed, algorithm)
    for values, dtype in outs:
        assert dtype == "torch.bfloat16" and values == outs[0][0]
        err = np.abs(np.array(values) - total)
        assert np.all(err <= gamma(p - 1, U["bfloat16"]) * magnitude)
        assert np.max(err) > 0  # bfloat16 really rounds (8 bits): the bound is not vacuous


def test_refusals_say_what_to_do(worlds, backend):
    name, message = worlds(2, backend).run(job_refused, "complex64")[0]
    assert name == "ConfigError" and "float16" in message and "numpy has no bfloat16" in message
    if backend not in ("torch", "cuda", "sim"):  # the backends that move torch tensors
        pytest.importorskip("torch")
        name, message = worlds(2, backend).run(job_refused, "torch-on-numpy-backend")[0]
        assert name == "ConfigError" and "t.numpy()" in message and "backend='torch'" in message


def test_bound_is_tight_enough_to_mean_something():
    """The bound is not vacuous: on these inputs float16 sums do err, by a sizeable part of it."""
    p, seed = 4, 44
    total, magnitude = exact(p, seed)
    fp16 = rank_data(seed, 0)
    for r in range(1, p):
        fp16 = (fp16 + rank_data(seed, r)).astype(np.float16)
    ratio = np.abs(fp16 - total) / (gamma(p - 1, U["float16"]) * magnitude)
    assert 0.1 < ratio.max() <= 1.0


# -- NCCL on a GPU: half types on device tensors, and a float16 numpy buffer through the host copy
# --

def half_inputs(seed: int, rank: int, dtype: str):
    import torch

    return torch.from_numpy(rank_data(seed, rank).astype(np.float32)).to(getattr(torch, dtype))


def job_cuda_half(comm, seed: int) -> dict:
    import torch

    out = {}
    for dtype in ("float16", "bfloat16"):
        for algorithm in ("ring", "tree", "native"):
            t = half_inputs(seed, comm.rank, dtype).to(comm.device)
            collectives.allreduce(comm, t, algorithm)
            out[dtype, algorithm] = (t.device.type, t.to(torch.float64).cpu().numpy())
    buf = rank_data(seed, comm.rank)
    collectives.allreduce(comm, buf, "ring")
    out["numpy"] = ("cpu", buf.astype(np.float64))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 2])
def test_half_types_on_nccl(monkeypatch, p):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < p:
        pytest.skip(f"needs {p} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    from dplab.backends.launch.world import World

    monkeypatch.setenv("DPLAB_DEVICE", "cuda")
    seed = 21
    with World(p, backend="torch", timeout=60.0) as w:
        results = w.run(job_cuda_half, seed)
    for key, (device, value) in results[0].items():
        dtype = "float16" if key == "numpy" else key[0]
        xs = [half_inputs(seed, r, dtype).double().numpy() for r in range(p)]
        err = np.abs(value - sum(xs))
        assert device == ("cpu" if key == "numpy" else "cuda"), key
        assert np.all(err <= gamma(p - 1, U[dtype]) * sum(np.abs(x) for x in xs)), key
        assert all(np.array_equal(r[key][1], value) for r in results), key
