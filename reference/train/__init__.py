"""The trainers: one device (the oracle), synchronous data parallelism, and what they share.

    single.py     TrainConfig, train_single: the single-device run every other run is checked against
    sync.py       train_sync: the data-parallel recipe (broadcast, shard, backward, all-reduce, step)
    buckets.py    Reducer: gradients in buckets, each all-reduced as soon as it is complete
    straggler.py  slow a rank down on purpose; the wall-time budget both trainers can stop on
"""
