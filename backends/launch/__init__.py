"""Starting ranks: ``launch(fn, world_size, backend)``, the persistent ``World``, a rank's loop.

    world.py      launch, World, RankError: fork local/torch ranks or start mpiexec, gather results
    engine.py     running under an engine's own launcher (mpiexec, torchrun)
    serve.py      one rank's loop: receive a function, run it on the communicator, send the result
"""
