"""The MPI backend over mpi4py's buffer API (``Isend``/``Irecv``, ``MPI_Allreduce``).

    setup.py      are mpi4py and an mpiexec there
    comm.py       MpiComm: one rank of MPI_COMM_WORLD speaking dplab's Communicator
    mpiexec.py    starting ranks with mpiexec from ``launch`` and stopping them
"""
