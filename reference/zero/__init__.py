"""Sharded data parallelism (ZeRO stages 0-3) in the reference trainer, and its memory formulas."""
