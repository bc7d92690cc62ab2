"""The local backend: NumPy processes on shared memory (the default, no engine needed).

    comm.py       LocalComm: send/recv through shared slots, receive-and-add out of a peer's memory
    wiring.py     the semaphores and slots a world shares, made before the ranks fork
    shm.py        shared-memory segments, named per world, swept when a world ends
"""
