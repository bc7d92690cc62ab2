"""Exercise (lesson 4): DDP's bucket assignment.

DDP does not all-reduce each gradient on its own (one latency per parameter) nor all of them
after the backward pass (the network idle while we compute): it groups parameters into buckets
and all-reduces a bucket as soon as all its gradients exist, while backward goes on.

Write ``ddp_buckets(sizes, cap)``. ``sizes[i]`` is parameter i's gradient in bytes, parameters in
FORWARD order (the first layer's weight is parameter 0); ``cap`` is the bucket cap in bytes.
Return the buckets, in the order they are launched, each a list of parameter indices, by the
rule of torch's DDP and of dplab's Reducer (dplab/reference/train/buckets.py):

  * walk the parameters in the order backward produces their gradients;
  * a bucket closes once it holds at least ``cap`` bytes; the next parameter opens a new one;
  * a parameter is never split: one larger than the cap closes the bucket it lands in.

The body below gets the cap rule right but walks the wrong way.

Check it (against the engine's own assignment, then by training with your buckets):

    dplab lesson check 4 DIR
"""

from __future__ import annotations


def ddp_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    buckets: list[list[int]] = [[]]
    held = 0
    for i in range(len(sizes)):  # TODO: is this the order backward makes gradients in?
        if buckets[-1] and held >= cap:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += sizes[i]
    return buckets
