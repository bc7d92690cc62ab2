"""The local backend: NumPy processes on shared memory (the default, no engine needed).

    setup.py      nothing to install; the semaphores and control segment, made before the fork
    comm.py       LocalComm: the Communicator, delegating to the parts below
    mailboxes.py  Mailboxes: send and receive over Memory, a descriptor and semaphores per message;
                  the Wiring the ranks share (made before they fork); the Waiter (spin, then sleep)
    memory.py     Memory: a rank's segments, staging, and the (kept) views into peers' segments
    oneshot.py    one_shot: the native all-reduce, each rank reducing its chunk in every buffer
    shm.py        shared-memory segments, named per world, swept when a world ends
"""
