"""Checkpoints: atomic, checksummed storage and resuming a run exactly where it stopped.

    store.py      save_checkpoint / load_checkpoint: temp file, fsync, rename, SHA-256 of every byte
    resume.py     CheckpointConfig: what the trainers save every k steps and how a run resumes
"""
