"""Exercise (lesson 15): an FSDP forward that prefetches the next unit's all-gather.

FSDP keeps a shard of each unit's weights on a rank and all-gathers a unit's whole weights just
before it runs. Gathered one after another, every gather is time the device waits. Prefetching
starts the NEXT unit's gather before this unit computes: the comm thread moves the bytes while
the device computes, and only the first gather is waited for.

Write forward_units(n_units, gather, compute):

    gather(u)      starts unit u's all-gather on the comm thread and returns at once a pair
                   (w, handle): w fills in while the gather runs; handle.wait() blocks until
                   it is done. Call it once per unit.
    compute(u, w)  runs unit u's forward with its whole weights (the device's time)

    - run the units 0..n_units-1 in order, each once, with the w of ITS gather, after ITS
      handle's wait (before that, w may be half gathered);
    - keep at most two units gathered, this one and the next: drop each w once its unit has run
      (FSDP's reshard: `del w`, or rebind the name);
    - start gather(u + 1) before compute(u), and wait for it only when unit u + 1 is next.

The check runs your function on 4 simulated H100s (dgx-h100, virtual time) and measures which
units were held when each ran, and how much of each gather ran under the previous compute.

The body below gathers each unit only when it is next: correct, and nothing overlaps. Check:

    dplab lesson check 15 DIR
"""

from __future__ import annotations


def forward_units(n_units, gather, compute):
    for u in range(n_units):
        w, handle = gather(u)
        handle.wait()
        compute(u, w)
