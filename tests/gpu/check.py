"""Every GPU check in one run, one table (``bash tests/gpu/check.sh``; under 5 minutes on one GPU).

Rows: the ``gpu``-marked tests; ``dplab train`` on the torch backend with NCCL against one device;
``dplab bench`` on CUDA (the device copy row, NCCL's all_reduce, our ring) and a plain
``Tensor.copy_`` timed beside it, which the copy row must match within 10%; the cuda backend's
rows (``cuda_rows.py``: train on 1-8 ranks of one GPU, the ring against the memory floor, DDP
against torch's over gloo). A speed target missed is ``MISS``, a wrong result ``FAIL``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS: list[tuple[str, str, str]] = []  # (check, result, verdict)


def dplab(*argv: str, json_rows: bool = True) -> tuple[int, list[dict], str]:
    """Run ``python -m dplab.backends.cli argv``; (exit code, its --json rows, its stderr tail)."""
    out = Path(tempfile.mkdtemp()) / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "dplab.backends.cli",
        *argv,
        *(["--json", str(out)] if json_rows else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return done.returncode, rows, (done.stderr or done.stdout).strip()[-300:]


def pytest_gpu() -> None:
    """The ``gpu`` tests, and the conformance suite on the cuda backend (marker ``cuda``)."""
    conformance = sorted(str(f) for f in Path("tests").glob("test_*.py")
                         if re.search(r"def test\w*\([^)]*\bbackend\b", f.read_text()))
    files = sorted(
        {
            "tests/test_gpu_nn.py",
            "tests/test_torch_backend.py",
            "tests/test_cuda_backend.py",
            *conformance,
        }
    )
    t0 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu or cuda",
        "-p",
        "no:cacheprovider",
        *files,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "DPLAB_EXAMPLES": "10"})
    if done.returncode not in (0, 5):
        print(done.stdout[-12000:], done.stderr[-1000:])  # what failed, above the table
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    verdict = (
        "ok" if done.returncode in (0, 5) and DEVICE == "cpu" or done.returncode == 0 else "FAIL"
    )
    ROWS.append(("pytest -m gpu", f"{last} ({time.monotonic() - t0:.0f} s)", verdict))


def train_nccl() -> None:
    label = f"train torch/{DEVICE} p=1 vs one device"
    rc, rows, err = dplab("train", "--backend", "torch", "--device", DEVICE, "--world-size", "1",
                          "--steps", "5")
    if rc or not rows:
        ROWS.append((label, err, "FAIL"))
        return
    diff = rows[0]["max_abs_diff_vs_single"]
    ROWS.append((label, f"max |diff| {diff:.2e}", "ok" if diff <= 1e-10 else "FAIL"))


def cuda_rows() -> None:
    """The cuda backend: train p = 1-8 vs one device, ring against the memory floor, DDP vs gloo."""
    cmd = [sys.executable, "tests/gpu/cuda_rows.py", *(["--cpu"] if DEVICE == "cpu" else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            ROWS.append((r["check"], r["result"], "ok" if r["ok"] else "MISS"))
    if done.returncode:
        ROWS.append(("cuda rows", (done.stderr or "no output").strip()[-300:], "FAIL"))


def copy_seconds(nbytes: int, iters: int = 0) -> float:
    """A plain device-to-device ``Tensor.copy_``, synchronised around the loop, per call."""
    # a small copy takes microseconds: many of them
    iters = iters or (2000 if nbytes < 16 << 20 else 50)
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def bench_cuda() -> None:
    sizes = {"1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}
    rc, rows, err = dplab(
        "bench",
        "--backends",
        "torch",
        "--device",
        DEVICE,
        "--world-sizes",
        "1",
        "--sizes",
        ",".join(sizes if DEVICE == "cuda" else ["1M"]),
        "--algorithms",
        "ring,native",
        "--reps",
        "3",
        "--target-seconds",
        "0.3",
    )
    if rc or not rows:
        ROWS.append((f"bench torch/{DEVICE} p=1", err, "FAIL"))
        return
    for r in rows:
        label = f"bench {r['algorithm']} p=1 {r['bytes'] >> 20} MiB"
        result = (f"{r['time_us']:,.1f} us, algbw {r['algbw_gbps']:,.0f} GB/s, "
                  f"busbw {r['busbw_gbps']:,.0f}")
        verdict = "ok"
        if r["algorithm"] == "memcpy" and DEVICE == "cuda":
            plain = copy_seconds(r["bytes"]) * 1e6
            result += f"; plain copy_ {plain:,.1f} us"
            verdict = (
                "ok" if abs(r["time_us"] / plain - 1) <= 0.10 else "FAIL (copy row vs copy_ > 10%)"
            )
        elif r["algorithm"] != "memcpy" and r["busbw_gbps"] != 0:
            verdict = "FAIL (busbw must be 0 at p=1)"
        ROWS.append((label, result, verdict))


DEVICE = "cuda"


def main() -> int:
    """``--cpu``: the same checks on the CPU, to try the script itself where no GPU is."""
    global DEVICE
    if "--cpu" in sys.argv[1:]:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (--cpu tries the script on the CPU)")
        return 2
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU (--cpu)"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if DEVICE == "cuda" else "-"
    t0 = time.monotonic()
    for check in (pytest_gpu, train_nccl, cuda_rows, bench_cuda):
        done = len(ROWS)
        try:
            check()
        except Exception as e:  # one row per failed check, and go on with the others
            ROWS.append((check.__name__, f"{type(e).__name__}: {e}"[:200], "FAIL"))
        for row in ROWS[done:]:  # as they come, too: a run cut short still shows what it measured
            print(" | ".join(row), flush=True)
    width = max(len(c) for c, _, _ in ROWS)
    print(f"\n{name}, torch {torch.__version__}, NCCL {nccl}, {time.monotonic() - t0:.0f} s")
    for check, result, verdict in ROWS:
        print(f"{check:<{width}}  {verdict:<6}  {result}")
    return 0 if all(v in ("ok", "MISS") for _, _, v in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
