"""The MPI backend over mpi4py's buffer API (``Isend``/``Irecv``, ``MPI_Allreduce``).

    comm.py       MpiComm: one rank of MPI_COMM_WORLD speaking dplab's Communicator
    mpiexec.py    starting ranks with mpiexec from ``launch`` and stopping them
"""
