"""The ``dplab`` command line and the experiments it runs.

    commands.py   the train/compare/bench commands and main(): tables, JSON, exit codes
    args.py       the argument parser: every option with its help and default
    checks.py     what is refused before any rank starts (paths, sizes, memory, devices)
    runs.py       RunSpec, run_train: one training run on a backend, checked against one device
    compare.py    the same run over a grid of backends x algorithms x world sizes (x modes)
    bench.py      nccl-tests-style all-reduce rows and the memory-copy ceiling
    table.py      tables and progress bars for the terminal
"""
