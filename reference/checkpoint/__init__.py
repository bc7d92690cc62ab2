"""Checkpoints: atomic, checksummed storage and resuming a run exactly where it stopped.

    store.py      save_checkpoint / load_checkpoint: temp file, fsync, rename, SHA-256 of every byte
    resume.py     CheckpointConfig: what the trainers save every k steps; Expect: what a checkpoint
                  must share with the run that resumes from it (backend, world size, algorithm,
                  model, at most this run's --steps, and parts that agree with each other)
"""
