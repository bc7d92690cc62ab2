"""The torch.distributed backend: gloo on CPU, NCCL on GPUs (one GPU per rank).

    setup.py      is torch there, which device, the start-up timeout (imports nothing of ours)
    p2p.py        TorchPeer: point-to-point messages, their tags and errors
    comm.py       TorchComm: a schedule's rounds over gloo or NCCL, the native all-reduce
    rendezvous.py prepare: the TCPStore on loopback that forked ranks meet at
"""
