"""The sim backend: the project's own code on a simulated cluster's virtual clock.

    from dplab.backends import launch, allreduce
    def step(comm):                                  # runs on every rank, with real data
        x = np.ones(1 << 20, dtype=np.float32)
        t0 = comm.now()                              # this rank's virtual clock, in seconds
        allreduce(comm, x, algorithm="ring")
        return comm.now() - t0                       # what the ring took on that cluster
    launch(step, 16, backend="sim", cluster="dgx-h100x2")      # 16 H100s on 2 DGX nodes

    dplab train --backend sim --cluster dgx-h100x2 --world-size 16 --trace run.json
    dplab scaling --backend sim --cluster dgx-h100x8 --world-sizes 1,2,4,8,16,32,64

    engine.py     virtual clocks, resources that queue, one actor at a time (the baton)
    network.py    messages: sends meet receives; a transfer holds the ports it crosses
    comm.py       SimComm, the Communicator; compute(flops, bytes), work(seconds), sleep(seconds)
    compute.py    what compute costs: the reference MLP's shapes, torch's operations (FLOP registry)
    threads.py    a world's threads, queues and clocks on virtual time, in its own process only
    timing.py     timing-only runs from the schedules alone (messages carry sizes): up to p = 1,024
    setup.py      the cluster (dplab.reference.cluster) and the world, made before the fork
    machine.py    this machine as a cluster (the ``this-machine`` preset), measured here
    validate.py   PERFORMANCE.md's validation rows: the simulator against measurements

Timing only (sizes, no bytes), from Python: ``timing.collective_time("dgx-h100x128", 1024,
"ring", 1 << 30).seconds``; ``timing.bench_rows(cluster, p, algorithms, sizes)``; any schedule
(several rings at once, a collective's phase): ``timing.schedule_time(cluster, schedule, nbytes)``.

A rank's trace (``comm.tracer``) records virtual nanoseconds; every printed row names its cluster.
The model and its validation: backends/README.md ("The sim backend") and backends/PERFORMANCE.md.
"""
