"""torch module wrappers over our collectives, on any backend.

    ddp.py        DistributedDataParallel: bucketed gradient all-reduce overlapped with backward
    zero.py       ZeroRedundancyOptimizer: ZeRO stage 1, optimizer state sharded across ranks
"""
