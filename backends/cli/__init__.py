"""The ``dplab`` command line and the experiments it runs.

    commands.py   argument parsing and the train/compare/bench commands
    runs.py       RunSpec, run_train: one training run on a backend, checked against one device
    compare.py    the same run over a grid of backends x algorithms x world sizes (x modes)
    bench.py      nccl-tests-style all-reduce rows and the memory-copy ceiling
    table.py      tables and progress bars for the terminal
"""
