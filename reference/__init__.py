"""dplab's ground truth, NumPy only: what data parallelism computes, with no transport in it.

    schedule.py simulate.py costmodel.py   collectives as data, checked and priced
    algorithms/                            one schedule per all-reduce: naive ring tree direct
                                           recursive_doubling rabenseifner double_tree
                                           pipelined_tree pipelined_ring hierarchical
    auto.py                                "auto": per call, the schedule the fitted cost model
                                           prices cheapest
    communicator.py collectives.py         the transport contract ("native": its engine's own
                                           all-reduce), and the executor over it
    train/                                 sync.py the recipe, buckets.py the reducer, single.py
                                           the oracle
    model.py data.py optim.py              the MLP, its data, SGD/momentum/Adam
    ps/ zero/ checkpoint/ precision/       parameter server, ZeRO, checkpoints, mixed precision
    trace.py errors.py                     events of real runs; the one error family

Nothing here imports ``dplab.backends``: the backends implement ``Communicator``. The whole
map is ``reference/README.md``.
"""
