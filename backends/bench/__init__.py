"""The all-reduce benchmark (``dplab bench``) without the command line: the app runs it too.

    spec = BenchSpec(world_sizes=(2,), sizes=(4096, 1 << 20), algorithms=("ring", "native"))
    spec.check()                           # one-line ConfigError before any rank starts
    rows = spec.run(World)                 # nccl-tests-style rows, one world per world size

    timing.py   what each rank times and how rows are made of it (algbw, busbw, the memcpy row)
    spec.py     BenchSpec: what to measure, checked up front (memory, /dev/shm), and the run
"""

from dplab.backends.bench.spec import BenchSpec, MemoryNeed, bench_memory_need
from dplab.backends.bench.timing import bench_rank, busbw_factor, parse_size, summarize

__all__ = ["BenchSpec", "MemoryNeed", "bench_memory_need", "bench_rank", "busbw_factor",
           "parse_size", "summarize"]
