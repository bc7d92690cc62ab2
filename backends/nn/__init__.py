"""torch module wrappers over our collectives, on any backend.

    ddp.py        DistributedDataParallel: bucketed gradient all-reduce overlapped with backward
    flat.py       flat buffers of parameters and gradients, shared by the three wrappers
    zero.py       ZeroRedundancyOptimizer: ZeRO stage 1, optimizer state sharded across ranks
    zero_state.py ZeRO's sharded optimizer state <-> torch.optim's state dict
    fsdp.py       FullyShardedDataParallel: parameters sharded per unit, gathered only while it
                  runs; its parameters under their own names, summon_full_params, state dicts,
                  clip_grad_norm_
    fsdp_flat.py  one unit's flat parameter: shard, gather into a freeable leaf, reduce-scatter
    fsdp_units.py which unit owns which parameter (tied ones once), units checked
    fsdp_precision.py  FSDP's compute dtype for the root's inputs and the buffers, per forward
"""
