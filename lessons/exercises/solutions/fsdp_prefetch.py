"""Solution (lesson 15): an FSDP forward that prefetches the next unit's all-gather.

The engine's, for the reference MLP: dplab/reference/zero/params.py (ShardedParams.acquire with
prefetch); for torch modules, forward_prefetch in dplab/backends/nn/fsdp.py.
"""

from __future__ import annotations


def forward_units(n_units, gather, compute):
    w, handle = gather(0)  # the only gather nothing hides
    for u in range(n_units):
        handle.wait()  # unit u's own handle: its weights are whole now
        nxt = gather(u + 1) if u + 1 < n_units else None  # runs under compute(u)
        compute(u, w)
        del w  # reshard: unit u's weights go; only the next unit's stay
        if nxt is not None:
            w, handle = nxt
