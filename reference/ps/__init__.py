"""Asynchronous data parallelism: a parameter server with bounded staleness (SSP).

``trainer.py`` has ``train_async`` and its picture; reference/README.md maps the other files.
Glossary (the words as this package uses them; two lags, in two units):

    SSP           stale synchronous parallel (Ho et al., 2013): workers run freely, except that
                  a worker may start clock c only once the slowest has finished c - s clocks.
    clock         one worker's round of pull, compute, push; its count of finished rounds.
                  Worker w's clock c trains on shard w - 1 of global batch c: a clock is a step.
    staleness     s, in CLOCKS: how far a worker may run ahead of the slowest worker
                  (``AsyncConfig.staleness``; 0 = lock-step, None = unbounded). The gate's bound.
    delay         in UPDATES: how many other updates the server applied between the version a
                  gradient was computed on and its own update (``LogEntry.delay``). Lock-step
                  still has delays up to W - 1; with staleness s, delay <= (W - 1)(2s + 1).
                  (``AsyncConfig.delays`` / ``max_delay_s`` are SECONDS a worker sleeps.)
    version       updates applied so far: the name of one state of the parameters.
    backup workers  with ``aggregate=True``, each clock's update uses the first W - b gradients
                  to arrive and drops the b late ones (Chen et al., 2016).
    two-shot      an all-reduce in two rounds: reduce-scatter, then all-gather, every rank
                  talking to every other directly (``direct``; see ``dplab.reference.train``).
"""
