"""Training runs and the files they leave: what ``dplab train``/``compare`` and the app's pages run.

    run.py        RunSpec, run_train: one training run on a backend, checked against one device
    grid.py       compare_specs: the same run over backends x algorithms x world sizes (x modes)
    uploads.py    bench rows and traces from someone else, checked before anything uses them

    from dplab.backends.runs import RunSpec, run_train
    row, events = run_train(RunSpec(world_size=4, algorithm="ring"))

No command line here: the CLI (``dplab.backends.cli``) and the app (``dplab.viz``) both build on it.
"""

from dplab.backends.runs.run import RunSpec, run_train

__all__ = ["RunSpec", "run_train"]
