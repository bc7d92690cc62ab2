"""The local backend: NumPy processes on shared memory (the default, no engine needed).

    comm.py       LocalComm: send/recv through shared slots, receive-and-add out of a peer's memory
    memory.py     its segments, staging, and the (kept) views into peers' segments
    waits.py      how a rank waits: a bounded spin while ranks have a core each, then sleep
    wiring.py     the semaphores and slots a world shares, made before the ranks fork
    shm.py        shared-memory segments, named per world, swept when a world ends
"""
