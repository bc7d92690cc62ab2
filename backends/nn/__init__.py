"""torch module wrappers over our collectives, on any backend.

    ddp.py        DistributedDataParallel: bucketed gradient all-reduce overlapped with backward
    zero.py       ZeroRedundancyOptimizer: ZeRO stage 1, optimizer state sharded across ranks
    zero_state.py ZeRO's sharded optimizer state <-> torch.optim's state dict
"""
