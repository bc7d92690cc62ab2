"""Starting ranks: ``launch(fn, world_size, backend)``, the persistent ``World``, a rank's loop.

    world.py      launch, World, RankError: start a world, gather results, name the rank that failed
    ranks.py      one start of a world's ranks: fork local/torch ranks or start mpiexec; end them
    serve.py      one rank's loop: receive a function, run it on the communicator, send the result
    watch.py      a rank's lifeline: it cleans up and exits once its launcher is gone
    interrupt.py  Ctrl-C and SIGTERM: cleanup no second signal can cut short; the CLI's one line
    timeouts.py   DPLAB_TIMEOUT (collectives) and DPLAB_START_TIMEOUT (start-up), checked
    mainmod.py    functions of the user's script (__main__) on MPI ranks, as spawn does
    engine.py     running under an engine's own launcher (mpiexec, torchrun)
"""
