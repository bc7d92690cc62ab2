"""The ``dplab`` command line and the experiments it runs.

    commands.py   the train/compare/bench commands and main(): tables, JSON, exit codes
    args.py       the argument parser: every option with its help and default
    checks.py     what is refused before any rank starts (paths, sizes, memory, devices)
    compare.py    runs a compare grid (``dplab.backends.runs``: RunSpec, run_train, the grids)
    bench.py      nccl-tests-style all-reduce rows and the memory-copy ceiling
    table.py      tables and progress bars for the terminal
"""
