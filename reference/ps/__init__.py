"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

    trainer.py    AsyncConfig, train_async: rank 0 serves, the other ranks pull, compute, push
    server.py     the server's loop: apply gradients in arrival order, answer pulls
    protocol.py   the messages between workers and the server, and their checks
    replay.py     replay the server's log on one device: the same parameters, exactly
"""
