"""dplab's transports, launchers, torch wrappers and command line: how bytes move.

The common case in one import:

    from dplab.backends import launch, allreduce

    def demo(comm):                       # runs on every rank
        x = np.full(4, comm.rank + 1.0)
        allreduce(comm, x, algorithm="ring")
        return x

    launch(demo, 3)                       # three local ranks -> three arrays of 6.0
    launch(demo, 3, backend="mpi")        # the same on MPI (mpiexec started for you)
    row, events = run_train(RunSpec(world_size=4, algorithm="tree"))   # train, checked vs one device

Rooms: ``launch/`` (launch, World), ``local/`` ``mpi/`` ``torchdist/`` (one per transport),
``nn/`` (DistributedDataParallel, ZeroRedundancyOptimizer), ``cli/`` (the ``dplab`` command
and the runs it makes).
"""

from dplab.backends.cli.runs import RunSpec, run_train
from dplab.backends.launch.world import BackendUnavailable, RankError, World, launch
from dplab.reference.collectives import allgather, allreduce, broadcast, reduce, reduce_scatter
from dplab.reference.train.single import TrainConfig

__all__ = ["launch", "World", "RankError", "BackendUnavailable", "allreduce", "reduce_scatter",
           "allgather", "broadcast", "reduce", "RunSpec", "run_train", "TrainConfig"]
