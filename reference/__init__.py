"""dplab's ground truth, NumPy only: what data parallelism computes, with no transport in it.

    schedule.py simulate.py costmodel.py   collectives as data, checked and priced
    algorithms/                            naive, ring, tree, direct: one schedule each
    communicator.py collectives.py         the transport contract, and the executor over it
    model.py data.py optim.py              the MLP, its data, SGD/momentum/Adam
    train/  ps/  checkpoint/               the trainers, the parameter server, checkpoints
    trace.py errors.py                     events of real runs; the one error family

Nothing here imports ``dplab.backends``: the backends implement ``Communicator``.
"""
