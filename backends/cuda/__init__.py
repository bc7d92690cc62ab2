"""The cuda backend: ranks as threads of one process, sharing each GPU's stream.

    setup.py      is there a GPU, which GPU a rank gets, the hub made before the fork
    hub.py        Hub: the ranks' inboxes; messages are views (plus CUDA events across GPUs),
                  never copies
    comm.py       CudaComm: a schedule's rounds and the one-shot native all-reduce on the device
"""
