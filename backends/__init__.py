"""dplab's transports, launchers, torch wrappers and command line: how bytes move.

The common case in one import (a learner's first script; on mpi, keep the ``__main__`` guard):

    import numpy as np
    from dplab.backends import allreduce, launch

    def demo(comm):                            # runs on every rank
        x = np.full(4, comm.rank + 1.0)
        allreduce(comm, x, algorithm="ring")   # in place: 1 + 2 + 3 on every rank
        return x

    if __name__ == "__main__":
        print(launch(demo, 3))                 # three local ranks, each [6. 6. 6. 6.]
        print(launch(demo, 3, backend="mpi"))  # the same on MPI (mpiexec started for you)

Training runs: ``from dplab.backends.runs import RunSpec, run_train``. The map: backends/README.md.
"""

from dplab.backends.fastpath.executor import allgather, allreduce, broadcast, reduce, reduce_scatter
from dplab.backends.launch.world import BackendUnavailable, RankError, World, launch

__all__ = ["launch", "World", "RankError", "BackendUnavailable", "allreduce", "reduce_scatter",
           "allgather", "broadcast", "reduce"]
