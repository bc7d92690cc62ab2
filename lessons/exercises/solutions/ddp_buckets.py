"""Solution (lesson 4): DDP's bucket assignment.

Backward produces the last layer's gradients first, so buckets are filled walking the parameters
in reverse; a bucket closes once it holds at least the cap (a parameter is never split). The
engine's: ``assign_buckets`` in dplab/reference/train/buckets.py.
"""

from __future__ import annotations


def ddp_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    buckets: list[list[int]] = [[]]
    held = 0
    for i in reversed(range(len(sizes))):  # the order backward makes the gradients in
        if buckets[-1] and held >= cap:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += sizes[i]
    return [b for b in buckets if b]
