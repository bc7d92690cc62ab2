"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

    trainer.py    AsyncConfig, train_async: rank 0 serves, the other ranks pull, compute, push
    server.py     the server's loop: apply gradients in arrival order, answer pulls
    gate.py       the SSP gate: may a worker start clock c yet?
    aggregate.py  aggregate=True: one update per clock, from the first W - b gradients
    lost.py       a dead worker told from a slow one; who will still send
    snapshot.py   the server's checkpoints, and resuming from one
    protocol.py   the messages between workers and the server, the log entry, shared arithmetic
    replay.py     replay the server's log on one device: the same parameters, bit for bit

Glossary (the words as this package uses them; two lags, in two units):

    SSP           stale synchronous parallel (Ho et al., 2013): workers run freely, except that
                  a worker may start clock c only once the slowest has finished c - s clocks.
    clock         one worker's round of pull, compute, push; its count of finished rounds.
                  Worker w's clock c trains on shard w - 1 of global batch c: a clock is a step.
    staleness     s, in CLOCKS: how far a worker may run ahead of the slowest worker
                  (``AsyncConfig.staleness``; 0 = lock-step, None = unbounded). The gate's bound.
    delay         in UPDATES: how many other updates the server applied between the version a
                  gradient was computed on and its own update (``LogEntry.delay``), i.e. how
                  stale the optimizer finds it. Lock-step still has delays up to W - 1; with
                  staleness s, delay <= (W - 1)(2s + 1). (Not ``AsyncConfig.delays`` /
                  ``max_delay_s``: those are SECONDS a worker sleeps, a handicap for tests.)
    version       updates applied so far: the name of one state of the parameters.
    backup workers  with ``aggregate=True``, each clock's update uses the first W - b gradients
                  to arrive and drops the b late ones (Chen et al., 2016).
    two-shot      an all-reduce in two rounds: reduce-scatter, then all-gather, every rank
                  talking to every other directly (``direct``; see ``dplab.reference.train``).
"""
