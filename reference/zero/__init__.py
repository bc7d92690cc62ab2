"""Sharded data parallelism (ZeRO stages 0-3) in the reference trainer, and its memory formulas.

    from dplab.backends import launch
    from dplab.reference.train.single import TrainConfig
    from dplab.reference.zero.train import ZeroConfig, train_zero
    results = launch(train_zero, 4, args=(TrainConfig(), ZeroConfig(stage=3)))
    results[0].memory          # rank 0's measured peak bytes: params, grads, optimizer, total

Read in this order: ``train.py`` (the recipe, one step for every stage), ``layout.py`` (which
chunk of every layer a rank owns), ``params.py`` and ``grads.py`` (where the stages differ),
``overlap.py`` (the comm thread), ``layers.py`` (the MLP one layer at a time), ``ledger.py``
(memory measured), ``traffic.py`` (bytes sent, from the trace), ``amp.py`` (mixed precision),
``memory.py`` (the paper's closed forms), ``config.py``.
"""
