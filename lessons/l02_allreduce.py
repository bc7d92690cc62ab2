"""Lesson 2: the all-reduce - naive, ring, tree, and the schedules the engines use.

    dplab lesson 2

Ten steps: count the bytes rank 0 really sends in a ring all-reduce (from a real run's trace);
write the ring's two halves yourself, the reduce-scatter and the all-gather (exercises); compare
every schedule's rounds and bytes; write a binomial-tree broadcast (exercise); price the
trade-off between latency and bandwidth with the alpha-beta model; and see how the links of a
cluster decide where the bytes should go (one ring through two NICs, a ring per NIC, the
hierarchical all-reduce); then, on a simulated GPU cluster, busbw against algbw, why NCCL runs
several channels, and ring, tree and NVLS from 8 to 1,024 GPUs.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dplab.backends import allreduce
from dplab.backends.bench.timing import busbw_factor
from dplab.backends.sim.timing import bench_rows, collective_time, schedule_time
from dplab.lessons.exercises import ring_allgather as allgather_exercise
from dplab.lessons.exercises import tree as tree_exercise
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.algorithms import allreduce_schedule, ring, tree
from dplab.reference.algorithms.double_tree import TREE_PIECES
from dplab.reference.cluster import cluster
from dplab.reference.columns import columns
from dplab.reference.costfit import terms
from dplab.reference.costmodel import closed_form, cost
from dplab.reference.nvls import nvls_time
from dplab.reference.pictures import render_arrows, render_rounds
from dplab.reference.schedule import Schedule, Transfer
from dplab.reference.simulate import is_allreduce, simulate
from dplab.reference.topology import PRESETS, Topology

__all__ = ["LESSON", "rings_per_nic"]

MIB = 1 << 20
# what the table compares: the three textbook schedules, then those the engines use
ALGORITHMS = ("naive", "ring", "tree", "recursive_doubling", "rabenseifner", "double_tree", "hierarchical:4")
# the ring's two halves are the next two exercises: shown is how they are joined and run, not written
RING_CODE = ("dplab.reference.algorithms.ring.allreduce", "dplab.reference.collectives.run_schedule")
STUB = "dplab.lessons.exercises.stubs"


def _picture(facts):
    from rich.text import Text
    return Text(facts["picture"])


def traced_allreduce(comm, nbytes, algorithm):
    # float32: 4 bytes an element
    buf = comm.empty(nbytes // 4, np.float32)
    buf[:] = comm.rank + 1
    comm.tracer.enabled = True
    allreduce(comm, buf, algorithm=algorithm)
    comm.tracer.enabled = False
    sends = [e for e in comm.tracer.take() if e.kind == "send"]
    return {"bytes": sum(e.bytes for e in sends),
            "messages": len(sends),
            "value": float(buf[0])}


def ring_bytes(lab):
    p, n = 4, MIB
    ranks = lab.world(p).run(traced_allreduce, n, "ring")
    return {"p": p, "n_bytes": n,
            "sent": ranks[0]["bytes"],
            "messages": ranks[0]["messages"],
            "formula": _ring_share(p, n),
            "naive_root": (p - 1) * n,
            "all_sent": [r["bytes"] for r in ranks],
            "all_sent_text": ", ".join(f"{r['bytes']:,}" for r in ranks),
            "sum": ranks[0]["value"],
            "expected_sum": float(sum(range(1, p + 1)))}


def _ring_share(p, n):
    """2(p-1)/p n: what each rank sends in a ring all-reduce (kept out of the shown code)."""
    return 2 * (p - 1) * n // p


def _ring_figure(facts):
    from dplab.viz.collectives import CollectiveConfig, walkthrough
    from dplab.viz.collectives_figure import figure
    return figure(walkthrough(CollectiveConfig("allreduce", "ring", world_size=facts["p"], n=8)))


def ring_round_zero(lab):
    p = 4
    engine = ring.reduce_scatter(p)
    # the stub writes round 0 only: the picture shows no more than the stub
    end = simulate(engine).holdings[-1]  # [rank, chunk, contributor]: times counted
    passes_on = all(t.chunk == u.chunk for k in range(1, p - 1) for t in engine.rounds[k]
                    for u in engine.rounds[k - 1] if u.dst == t.src)
    return {"p": p, "last": p - 1,
            "rounds": len(engine.rounds),
            "picture": render_rounds(engine, rounds=[0]),
            "passes_on": passes_on,
            "own_chunk_complete": all((end[r, r] == 1).all() for r in range(p)),
            "round1_rank0_chunk": next(t.chunk for t in engine.rounds[1] if t.src == 0),
            "round0_rank0_chunk": next(t.chunk for t in engine.rounds[0] if t.src == 0)}


def allgather_round_zero(lab):
    p = 4
    whole = ring.allreduce(p)  # reduce-scatter, then all-gather
    gather = ring.allgather(p)
    sim = simulate(whole).holdings
    after_rs = sim[p - 1]
    return {"p": p,
            "rounds": len(gather.rounds),
            # the state the reduce-scatter leaves, and the all-gather's first round: as the stub
            "picture": render_rounds(whole, rounds=[p - 1]).replace(
                f"round {p - 1}\n", f"round {p - 1} (the all-gather's round 0)\n", 1),
            "rs_leaves_own": all((after_rs[r, r] == 1).all() for r in range(p)),
            "allreduce": is_allreduce(simulate(whole)),
            "copies": all(t.op == "copy" for rnd in gather.rounds for t in rnd)}


def schedules_compared(lab):
    p, n = 8, MIB
    rows = []
    for name in ALGORITHMS:
        schedule = allreduce_schedule(name, p)
        # on the critical path: alpha and beta counts
        messages, path_bytes, _ = terms(name, p, n)
        busiest = cost(schedule, n, 0, 0, 0, itemsize=4).bytes_sent_max
        rows.append({"algorithm": name,
                     "rounds": len(schedule.rounds),
                     "alphas": int(messages),
                     "busiest_sends_n": busiest / n,
                     "correct": is_allreduce(simulate(schedule))})
    by = {r["algorithm"]: r for r in rows}
    table = "\n".join(
        f"| {r['algorithm']} | {r['rounds']} | {r['alphas']} "
        f"| {r['busiest_sends_n']:.3g} n |" for r in rows)
    fewest = min(rows, key=lambda r: r["alphas"])["algorithm"]
    # the path's α: per round, the most messages one rank sends or receives (one port, one at a time)
    dt = allreduce_schedule("double_tree", p)
    dt_path = sum(max(max(Counter(t.src for t in rnd).values()), max(Counter(t.dst for t in rnd).values()))
                  for rnd in dt.rounds)
    # at scale: the double tree's path grows with lg p, the ring's with p
    scale = {q: (int(terms("double_tree", q, n)[0]), int(terms("ring", q, n)[0]))
             for q in (64, 256)}
    return {"p": p, "rows": rows, "by": by, "table": table,
            "fewest_alphas": fewest, "dt_path": dt_path, "scale": scale,
            "dt_64": scale[64][0], "ring_64": scale[64][1],
            "dt_256": scale[256][0], "ring_256": scale[256][1],
            "dt_pieces": TREE_PIECES,
            "picture": render_arrows(tree.allreduce(p))}


def _tree_figure(facts):
    from dplab.viz.collectives import CollectiveConfig, walkthrough
    from dplab.viz.collectives_figure import figure
    return figure(walkthrough(CollectiveConfig("allreduce", "tree", world_size=facts["p"], n=8)))


def tree_holders(lab):
    out = {"p": 8}
    for p in (8, 6):
        schedule = tree.broadcast(p)
        root_only = np.eye(p, dtype=np.int64)[0]  # rank 0's part and nothing else
        # holdings[round][rank, chunk 0, contributor]: who holds the root's buffer
        have = [int((h[:, 0, :] == root_only).all(axis=1).sum())
                for h in simulate(schedule).holdings]
        out[p] = {"rounds": len(schedule.rounds), "holders": have}
    out["rounds"] = out[8]["rounds"]
    out["doubling"] = out[8]["holders"] == [1, 2, 4, 8]
    out["picture"] = "ranks holding the root's buffer, round by round:\n" + "\n".join(
        f"  p = {p}: " + " -> ".join(map(str, out[p]["holders"])) for p in (8, 6))
    return out


def latency_or_bandwidth(lab):
    # 100 Gb/s Ethernet, 5 us a message: one link for every message
    p, net = 8, Topology.flat(5e-6, 1 / 12.5e9, 0.0, "100g")
    small, large = 4 << 10, 64 * MIB
    rd = "recursive_doubling"
    times = {(a, n): cost(allreduce_schedule(a, p), n, itemsize=4,
                          topology=net).time
             for a in ("ring", rd) for n in (small, large)}
    alpha = net.intra.alpha
    return {"p": p, "small": small, "large": large,
            "alpha_us": alpha * 1e6,
            "gbps": round(1e-9 / net.intra.beta, 6),  # 12.5, as the Cost page offers it
            "ring_small_us": times["ring", small] * 1e6,
            "rd_small_us": times[rd, small] * 1e6,
            "ring_large_ms": times["ring", large] * 1e3,
            "rd_large_ms": times[rd, large] * 1e3,
            "ring_alpha_share": 2 * (p - 1) * alpha / times["ring", small],
            "small_winner": min(("ring", rd), key=lambda a: times[a, small]),
            "large_winner": min(("ring", rd), key=lambda a: times[a, large])}


def rings_per_nic(p, g, channels=None):
    """g ring all-reduces at once (or ``channels`` of them), each over its
    share of the buffer (as NCCL's channels): ring j leaves every node
    through its local rank j, so each ring has its own NIC between nodes."""
    channels = channels or g
    rs, ag = [[] for _ in range(p - 1)], [[] for _ in range(p - 1)]
    for j in range(channels):
        order = [node * g + (j + 1 + i) % g
                 for node in range(p // g) for i in range(g)]
        for k in range(p - 1):
            for i, r in enumerate(order):
                right = order[(i + 1) % p]
                # ring j owns chunks j p .. j p + p - 1
                rs[k].append(Transfer(r, right, j * p + (i - k - 1) % p,
                                      "reduce"))
                ag[k].append(Transfer(r, right, j * p + (i - k) % p, "copy"))
    return Schedule("rings_per_nic", p, channels * p, rs + ag)


# the DGX H100's two links, GB/s each way, as the questions and texts of steps 7 and 9 give them
DGX_GBPS = {"dgx_nvlink_gbps": 1e-9 / PRESETS["dgx-h100"].intra.beta,
            "dgx_nic_gbps": 1e-9 / PRESETS["dgx-h100"].inter.beta}


def slow_links(lab):
    # two nodes of 8 GPUs, every GPU its own NIC
    topo, p, n = PRESETS["dgx-h100"], 16, 256 * MIB
    g = topo.ranks_per_node
    out = {"p": p, "g": g, "nodes": p // g, "nics": p, "n_mib": n // MIB}
    for key, schedule in (("ring", allreduce_schedule("ring", p)),
                          ("hier", allreduce_schedule(f"hierarchical:{g}", p)),
                          ("rpn", rings_per_nic(p, g))):
        t, chunk = columns(schedule), n / schedule.num_chunks
        # this transfer leaves its node:
        between = (t.src // g) != (t.dst // g)
        inter = np.bincount(t.src[between], minlength=p).max()
        total = np.bincount(t.src, minlength=p).max()
        out[f"{key}_nics_used"] = len(set(t.src[between].tolist()))
        out[f"{key}_inter_n"] = int(inter) * chunk / n
        out[f"{key}_total_n"] = int(total) * chunk / n
        out[f"{key}_ms"] = cost(schedule, n, itemsize=4, topology=topo).time * 1e3
        out[f"{key}_small_us"] = cost(schedule, 64 << 10, itemsize=4, topology=topo).time * 1e6
        out[f"{key}_rounds"] = len(schedule.rounds)
        out[f"{key}_correct"] = is_allreduce(simulate(schedule))
    # NCCL's channels run concurrently: one ring of the g alone, on its share
    ring0 = Schedule("one_channel", p, g * p,
                     [[t for t in rnd if t.chunk < p] for rnd in rings_per_nic(p, g).rounds])
    out["channel_small_us"] = cost(ring0, 64 << 10, itemsize=4, topology=topo).time * 1e6
    out["factor"] = out["ring_inter_n"] / out["hier_inter_n"]
    out["idle"] = p - out["ring_nics_used"]
    return out


def bus_and_alg(lab):
    # nccl-tests' two numbers, from dplab bench's rows on a simulated DGX H100 node
    c, p = cluster("dgx-h100"), 8
    small, large = 64 << 10, 256 * MIB
    rows = {r["bytes"]: r for r in bench_rows(c, p, ["ring"], [small, large])
            if r["algorithm"] == "ring"}
    nvls = large / nvls_time(c, p, large)  # algbw = S / t
    return {"p": p, "cluster": c.name, "large": large, "small": small,
            "link_gbps": 1e-9 / c.intra.beta,
            "ring_ms": rows[large]["time_us"] / 1e3,
            "algbw": rows[large]["algbw_gbps"], "busbw": rows[large]["busbw_gbps"],
            "small_busbw": rows[small]["busbw_gbps"],
            "factor": busbw_factor(p),
            "nvls_algbw": nvls / 1e9, "nvls_busbw": nvls * busbw_factor(p) / 1e9}


def channels_fill_nics(lab):
    # two DGX H100 nodes: 1, 2, 4 or 8 rings at once, ring j through NIC j
    c, p, g, n = cluster("dgx-h100x2"), 16, 8, 256 * MIB
    busbw = {}
    for k in (1, 2, 4, 8):
        seconds = schedule_time(c, rings_per_nic(p, g, k), n).seconds
        busbw[k] = n / seconds * busbw_factor(p) / 1e9
    return {"p": p, "g": g, "cluster": c.name, "n": n,
            "nic_gbps": 1e-9 / c.inter.beta, "link_gbps": 1e-9 / c.intra.beta,
            "busbw": busbw, "one": busbw[1], "eight": busbw[8],
            "gain": busbw[8] / busbw[1],
            "rows": "\n".join(f"| {k} | {b:.0f} GB/s |" for k, b in busbw.items())}


def _ring_between_nodes(c, p, n):
    """The ring's closed form where every round crosses a NIC (several nodes)."""
    return closed_form("ring", p, n, c.inter.alpha, c.inter.beta, c.gamma)


def ring_tree_nvls(lab):
    # 1 MiB, where the latencies decide, on 1, 8 and 128 DGX nodes
    n, out = MIB, {}
    for p in (8, 64, 1024):
        c = cluster(f"dgx-h100x{p // 8}")
        # the ring at p = 1,024 is 2 million messages: its closed form, each
        # round at the NIC's pace, which the sim equals (checked at 64)
        ring = (collective_time(c, p, "ring", n).seconds if p <= 64 else
                _ring_between_nodes(c, p, n))
        out[p] = {"ring": ring * 1e3,
                  "tree": collective_time(c, p, "double_tree", n).seconds * 1e3,
                  "nvls": nvls_time(c, p, n) * 1e3}
    model64 = _ring_between_nodes(cluster("dgx-h100x8"), 64, n) * 1e3
    big = 256 * MIB
    one = {a: collective_time("dgx-h100", 8, a, big).seconds * 1e3 for a in ("ring", "double_tree")}
    one["nvls"] = nvls_time("dgx-h100", 8, big) * 1e3
    names = ("ring", "tree", "nvls")
    fastest = {p: min(names, key=lambda a: out[p][a]) for p in out}
    return {"n": n, "big": big, "by_p": out, "model64": model64, "fastest_1024": fastest[1024],
            "fastest": fastest, "one": one,
            "rows": "\n".join(f"| {p:,} | {r['ring']:.3f} | {r['tree']:.3f} | {r['nvls']:.3f} |"
                              for p, r in out.items()),
            "ring_1024": out[1024]["ring"], "tree_1024": out[1024]["tree"],
            "nvls_1024": out[1024]["nvls"], "nvls_8": out[8]["nvls"], "ring_8": out[8]["ring"],
            "big_ring": one["ring"], "big_tree": one["double_tree"], "big_nvls": one["nvls"]}


STEPS = (
    Step(
        title="Bytes on the wire: a real ring all-reduce",
        text=("Four ranks all-reduce {n_bytes:,} bytes (1 MiB of float32) with the ring, the trace on. "
              "Rank 0 sent **{sent:,} bytes** in {messages} messages: 2(p-1)/p of the buffer "
              "({formula:,}), and so did every rank ({all_sent_text}).\n\n"
              "The ring cuts the buffer into p chunks. In p-1 rounds of **reduce-scatter** each rank passes "
              "one chunk to its right neighbour, who adds its own part and passes it on; then rank r holds "
              "chunk r complete. In p-1 rounds of **all-gather** the finished chunks travel on, copied. "
              "2(p-1) messages of n/p bytes each. Every element ends as 1+2+3+4 = {sum:g}.\n\n"
              "The naive way (everyone sends to rank 0, which sends the sum back) makes rank 0 send "
              "{naive_root:,} bytes: p-1 whole buffers. The code below joins the ring's two halves (you "
              "write each of them in the next two steps) and is the executor that runs any schedule, round "
              "by round, on every backend."),
        run=ring_bytes,
        checks=(Check("rank 0 sends 2(p-1)/p · n bytes ({formula:,})", lambda f: f["sent"] == f["formula"]),
                Check("in 2(p-1) messages, one chunk per round", lambda f: f["messages"] == 2 * (f["p"] - 1)),
                Check("every rank sends the same", lambda f: len(set(f["all_sent"])) == 1),
                Check("every element holds the sum 1+...+p", lambda f: f["sum"] == f["expected_sum"])),
        figure=_ring_figure,
        predict=Predict("How many bytes does rank 0 send in a ring all-reduce of {n_bytes:,} bytes "
                        "(1 MiB) at p={p}?", "sent", unit="bytes", misconceptions=(
                            (lambda g, f: g == (f["p"] - 1) * f["n_bytes"],
                             "p-1 whole buffers is what the naive root sends; the ring never sends a whole "
                             "buffer, only chunks of n/p"),
                            (lambda g, f: g == f["n_bytes"],
                             "one copy of the buffer, but the ring sends every chunk twice: once to be "
                             "summed, once to be shared"),
                            (lambda g, f: g == (f["p"] - 1) * f["n_bytes"] // f["p"],
                             "that is one half: the reduce-scatter; the all-gather sends as much again"),
                            (lambda g, f: g == 2 * f["n_bytes"],
                             "2n is where 2(p-1)/p n tends as p grows; at p = 4 it is 1.5 n"))),
        hint="Count rounds and chunk sizes: the buffer is cut into p chunks of n/p bytes.",
        hints=("Two phases, p-1 rounds each, one chunk sent per round.",
               "2(p-1) · n/p = 6 · 256 KiB."),
        try_this="dplab train --world-size 4 --algorithm ring --trace run.json   # every send is traced",
        explore=Explore("collectives", lambda f: {"algorithm": "ring", "p": f["p"], "n": 8}),
        teaches=("allreduce",),
        show=RING_CODE,
        inputs={"p": 4, "n_bytes": MIB},
    ),
    Step(
        title="Exercise: the ring reduce-scatter, round by round",
        text=("Now write the first half yourself. `dplab lesson init DIR` copies the exercise stubs into "
              "DIR; fill in `ring_reduce_scatter(p) -> Schedule` and run `dplab lesson check 2 DIR`: it "
              "runs your schedule in the simulator and says what is wrong in the lesson's words (which rank "
              "holds which chunk counted how many times, after which round).\n\n"
              "The stub already writes round 0, drawn here by the simulator at p={p} (`d0` is chunk d "
              "holding rank 0's part; `c03` holds rank 0's and rank 3's). What must hold when you are "
              "done: after p-1 rounds rank r holds chunk r, every rank's part in it exactly once "
              "({own_chunk_complete} for the engine's), and in every round each rank sends one chunk to "
              "its right neighbour.\n\n```\n{picture}\n```"),
        run=ring_round_zero,
        checks=(Check("after p-1 rounds the engine's rank r holds chunk r, each contribution once",
                      lambda f: f["own_chunk_complete"]),
                Check("in every round after the first, a rank passes on the chunk it received the round "
                      "before", lambda f: f["passes_on"]),
                Check("p-1 rounds", lambda f: f["rounds"] == f["p"] - 1)),
        predict=Predict("At p={p}, in round 0 rank 3 sends chunk 2 to rank 0, which adds its part. Which "
                        "chunk (a number, 0 to {last}) does rank 0 send in round 1?", "round1_rank0_chunk",
                        misconceptions=(
                            (3, "chunk 3 is what rank 0 sent in round 0; in round 1 it passes on what it "
                                "received"),
                            (0, "chunk 0 is rank 0's own: it must end there, complete, so rank 0 never "
                                "sends it in the reduce-scatter"),
                            (1, "chunk 1 is what rank 0 sends in round 2: it arrives from rank 3 in "
                                "round 1"))),
        hint="Look at the picture: after round 0, which chunk on rank 0 holds two parts?",
        hints=("A rank passes on the chunk it just received, with its own part added: the chunk grows by "
               "one part at every rank it passes.",
               "Round k: rank r sends chunk (r - k - 1) mod p. For round 1, rank 0: (0 - 1 - 1) mod 4."),
        try_this="dplab lesson init ex && dplab lesson check 2 ex   # then edit ex/ until the check passes",
        explore=Explore("collectives", lambda f: {"collective": "reduce_scatter", "algorithm": "ring",
                                                  "p": f["p"], "n": 8}),
        exercise="ring_reduce_scatter",
        teaches=("allreduce",),
        show=(f"{STUB}.ring_reduce_scatter.ring_reduce_scatter",),
        inputs={"p": 4, "last": 3},
    ),
    Step(
        title="Exercise: the ring all-gather, the second half",
        text=("The reduce-scatter leaves rank r holding chunk r complete ({rs_leaves_own}) and only "
              "pieces of the others. The all-gather shares the finished chunks: the same ring, one chunk a "
              "round to the right neighbour, but now nothing is added, the receiver copies (`==x==>` in "
              "the picture). The stub writes round 0, the state the reduce-scatter left and what each "
              "rank sends first:\n\n```\n{picture}\n```\n\n"
              "Write `ring_allgather(p)` in the same folder and check it with `dplab lesson check 2 DIR`; "
              "with your reduce-scatter before it, it is a whole ring all-reduce ({allreduce} for the "
              "engine's)."),
        run=allgather_round_zero,
        checks=(Check("the reduce-scatter leaves rank r holding chunk r complete",
                      lambda f: f["rs_leaves_own"]),
                Check("the all-gather takes p-1 rounds and only copies",
                      lambda f: f["rounds"] == f["p"] - 1 and f["copies"]),
                Check("reduce-scatter then all-gather is an all-reduce (the simulator's counts)",
                      lambda f: f["allreduce"])),
        predict=Predict("At p={p}, every rank holds one chunk complete and lacks the others. One new chunk "
                        "arrives per round: how many rounds does the ring all-gather take?", "rounds",
                        misconceptions=(
                            (4, "p rounds would send each rank a chunk it already has: it starts with one"),
                            (2, "lg p rounds needs a rank to receive more than one chunk a round (recursive "
                                "doubling's all-gather does, sending twice as much each round)"))),
        hint=allgather_exercise.HINTS[0],
        hints=allgather_exercise.HINTS[1:],
        try_this="dplab lesson check 2 ex   # ring_allgather.py is judged after the engine's reduce-scatter",
        explore=Explore("collectives", lambda f: {"collective": "allgather", "algorithm": "ring",
                                                  "p": f["p"], "n": 8}),
        exercise="ring_allgather",
        teaches=("allreduce",),
        show=(f"{STUB}.ring_allgather.ring_allgather",),
        inputs={"p": 4},
    ),
    Step(
        title="Naive, ring, tree and the others: rounds against bytes",
        text=("Two prices matter for a message. **α** (alpha) is the latency: the fixed cost of one "
              "message, however small (a few µs on a network). Then every byte costs time at the link's "
              "bandwidth. Messages that must happen one after another form the **critical path**: its "
              "length in messages, times α, is the latency an all-reduce cannot avoid.\n\n"
              "Every all-reduce in the engine is a schedule, and the simulator proves each one correct "
              "(every chunk on every rank holds each contribution exactly once). At p={p}, per schedule: "
              "its rounds, the messages on its critical path, and the bytes its busiest rank sends "
              "(n = the buffer):\n\n"
              "| algorithm | rounds | α on the path | busiest rank sends |\n|---|---|---|---|\n{table}\n\n"
              "No schedule wins both columns. The ring (and Rabenseifner, and the hierarchical ring) send "
              "the least here, 2(p-1)/p n: the least any all-reduce can send when the network only carries "
              "bytes (Patarasuk & Yuan 2009). A switch that adds (NVIDIA's NVLS on NVSwitch, SHARP on "
              "InfiniBand) changes that: each rank sends its n once and receives the sum once. Recursive "
              "doubling needs the fewest latencies, lg p, but sends the whole buffer in each round. The "
              "tree does lg p rounds up and lg p down (the picture: its arrows, round by round). Naive has "
              "only 2 rounds, but its root receives p-1 whole buffers in the first, one after the other "
              "through its one port: 2(p-1) latencies, like the ring, and the most bytes. double_tree "
              "(NCCL's: two binary trees, each reducing and broadcasting half the buffer, cut into "
              "{dt_pieces} pieces that flow one behind the other) has few rounds for its pieces, but in "
              "most of them a rank sends or receives 2 to 4 pieces (two trees, a parent and children) one "
              "after another through its one port; the path counts, round by round, the most messages one "
              "rank handles: {dt_path} α, more than the ring's at p = {p}. NCCL runs it anyway (NCCL 2.4) "
              "because its path grows with the trees' depth, lg p, and the ring's with p: priced the "
              "same way, {dt_64} α against the ring's {ring_64} at p = 64, and {dt_256} against "
              "{ring_256} at p = 256: for a small message, where the α are the time, that is what decides. "
              "hierarchical:4 is a ring inside groups of 4 ranks, then between the groups (step 7)."),
        run=schedules_compared,
        checks=(Check("the simulator proves every schedule an all-reduce",
                      lambda f: all(r["correct"] for r in f["rows"])),
                Check("the ring sends 2(p-1)/p n, the least of these schedules",
                      lambda f: f["by"]["ring"]["busiest_sends_n"] == 2 * (f["p"] - 1) / f["p"]
                      == min(r["busiest_sends_n"] for r in f["rows"])),
                Check("no schedule wins both: the one with the fewest latencies sends more than the least",
                      lambda f: f["by"][f["fewest_alphas"]]["busiest_sends_n"]
                      > min(r["busiest_sends_n"] for r in f["rows"])),
                Check("naive sends the most: p-1 whole buffers",
                      lambda f: f["by"]["naive"]["busiest_sends_n"] == f["p"] - 1),
                Check("recursive doubling takes lg p rounds, fewer than tree (2 lg p) and ring (2(p-1))",
                      lambda f: f["by"]["recursive_doubling"]["rounds"] == f["p"].bit_length() - 1
                      < f["by"]["tree"]["rounds"] < f["by"]["ring"]["rounds"]),
                Check("double_tree's α on the path is, round by round, the most messages one rank handles",
                      lambda f: f["by"]["double_tree"]["alphas"] == f["dt_path"]),
                Check("the latency count of the ring is 2(p-1)",
                      lambda f: f["by"]["ring"]["alphas"] == 2 * (f["p"] - 1)),
                Check("at p = 8 the double tree's path is longer than the ring's; at p = 64 and 256 it "
                      "is the shorter, and grows far slower",
                      lambda f: f["dt_path"] > f["by"]["ring"]["alphas"]
                      and all(dt < ring == 2 * (q - 1) for q, (dt, ring) in f["scale"].items())
                      and f["dt_256"] - f["dt_64"] < (f["ring_256"] - f["ring_64"]) / 10)),
        figure=_tree_figure,
        predict=Predict("At p={p}, which schedule pays the fewest latencies (α) on its critical path? "
                        "(double_tree: NCCL's two binary trees, each carrying half the buffer in pieces; "
                        "hierarchical:4: a ring inside groups of 4 ranks, then between the groups)",
                        "fewest_alphas", choices=ALGORITHMS, misconceptions=(
                            ("naive", "naive has 2 rounds, but its root takes p-1 messages one after the "
                                      "other: 2(p-1) latencies"),
                            ("tree", "the tree needs lg p rounds to reduce and lg p more to broadcast"),
                            ("ring", "the ring pays 2(p-1): the most rounds of all"))),
        hint="Count how many ranks' parts a rank holds after each round.",
        hints=("Each round of recursive doubling doubles how many ranks' parts every rank holds.",),
        try_this="dplab app   # Collectives page: pick an algorithm, press Play, watch the bytes counter",
        explore=Explore("collectives", lambda f: {"algorithm": "tree", "p": f["p"], "n": 8}),
        teaches=("allreduce",),
        # the simulator that proves every row; the tree's own code would answer the next exercise
        show=("dplab.reference.simulate.simulate", "dplab.reference.simulate.is_allreduce"),
        picture=_picture,
        inputs={"p": 8},
    ),
    Step(
        title="Exercise: a binomial-tree broadcast",
        text=("The tree's second half is a broadcast: the root's buffer goes to every rank. One rank sends "
              "one message a round, so the root alone would need p-1 rounds. In a binomial tree every rank "
              "that already holds the buffer sends it on, and the holders double each round. The engine's, "
              "counted by the simulator:\n\n```\n{picture}\n```\n\n"
              "p need not be a power of two: at p = 6 some ranks sit a round out. Write "
              "`tree_broadcast(p, root)` in the same folder and check it with `dplab lesson check 2 DIR`: "
              "it is judged for p = 1..9 and for roots other than 0."),
        run=tree_holders,
        checks=(Check("the holders double every round at p = 8: 1, 2, 4, 8", lambda f: f["doubling"]),
                Check("ceil(lg p) rounds: 3 at p = 8 and at p = 6",
                      lambda f: f[8]["rounds"] == f[6]["rounds"] == 3),
                Check("every rank ends with the root's buffer", lambda f: f[8]["holders"][-1] == 8
                      and f[6]["holders"][-1] == 6)),
        predict=Predict("A binomial-tree broadcast from rank 0 to p={p} ranks: how many rounds?", "rounds",
                        misconceptions=(
                            (7, "p-1 rounds is the root sending alone, or a chain; in a tree every rank that "
                                "holds the buffer sends too"),
                            (8, "p ranks, but the root holds the buffer from the start, and the holders "
                                "double each round"))),
        hint=tree_exercise.HINTS[0],
        hints=tree_exercise.HINTS[1:],
        try_this="dplab lesson check 2 ex   # tree_broadcast.py is judged for p = 1..9 and several roots",
        explore=Explore("collectives", lambda f: {"collective": "broadcast", "algorithm": "tree",
                                                  "p": f["p"], "n": 8}),
        exercise="tree_broadcast",
        teaches=("allreduce",),
        show=(f"{STUB}.tree_broadcast.tree_broadcast",),
        inputs={"p": 8},
    ),
    Step(
        title="The trade-off: latency or bandwidth",
        text=("Time = α per message on the critical path + β per byte, with β = 1/bandwidth. On 100 Gb/s "
              "Ethernet (α = {alpha_us:g} µs, {gbps:g} GB/s each way) at p={p}, in the model:\n\n"
              "- **{small:,} bytes**: ring {ring_small_us:.1f} µs, recursive doubling {rd_small_us:.1f} µs. "
              "The ring's 2(p-1) latencies are {ring_alpha_share:.0%} of its time: small messages are "
              "latency-bound, and fewer rounds win ({small_winner}).\n"
              "- **{large:,} bytes**: ring {ring_large_ms:.1f} ms, recursive doubling {rd_large_ms:.1f} ms. "
              "Now the bytes dominate, and sending less wins ({large_winner}).\n\n"
              "That is why NCCL and MPI switch algorithms by message size (lesson 3 prices where)."),
        run=latency_or_bandwidth,
        checks=(Check("small messages: recursive doubling beats the ring",
                      lambda f: f["rd_small_us"] < f["ring_small_us"]),
                Check("large messages: the ring beats recursive doubling",
                      lambda f: f["ring_large_ms"] < f["rd_large_ms"]),
                Check("the ring's small message is mostly latency (> 50%)",
                      lambda f: f["ring_alpha_share"] > 0.5),
                Check("the question's α is the link's: 5 µs", lambda f: abs(f["alpha_us"] - 5) < 1e-9)),
        predict=Predict("At p={p} on 100 Gb/s Ethernet (α = 5 µs), which is faster for a {small:,}-byte "
                        "all-reduce: 'ring' or 'recursive_doubling'?", "small_winner",
                        choices=("ring", "recursive_doubling"), misconceptions=(
                            ("ring", "the ring sends fewer bytes, but 4 KiB take about 0.3 µs on this link "
                                     "while each of its 14 messages costs 5 µs"),)),
        hint="Compare the latencies: the ring pays 2(p-1) of them, recursive doubling lg p.",
        hints=("14 latencies of 5 µs is 70 µs; 4 KiB at 12.5 GB/s is about 0.3 µs.",),
        try_this="dplab app   # Cost page: move α and β and watch the crossover move",
        explore=Explore("cost", lambda f: {"p": f["p"], "alpha_us": f["alpha_us"], "beta_gbps": f["gbps"]}),
        teaches=("bandwidth-latency",),
        show=("dplab.reference.costmodel.cost",),
        inputs={"p": 8, "small": 4 << 10},
    ),
    Step(
        title="Topology: keep the bytes off the slow links",
        text=("A cluster has two kinds of link: GPUs in a node talk over NVLink ({dgx_nvlink_gbps:.0f} "
              "GB/s each way on a DGX H100), nodes over InfiniBand, one {dgx_nic_gbps:.0f} GB/s NIC per "
              "GPU. At p={p} ({nodes} nodes of {g}, "
              "{nics} NICs), all-reducing {n_mib} MiB, in the model:\n\n"
              "- **one ring**: its neighbours sit in the same node except at the two node boundaries, so "
              "only {ring_nics_used} of the {nics} NICs carry it, each sending {ring_inter_n:.3g} n between "
              "nodes: {ring_ms:.2f} ms;\n"
              "- the **hierarchical** all-reduce reduce-scatters inside each node, all-reduces across nodes "
              "only a 1/{g} piece (every GPU on its own NIC), and all-gathers inside again: "
              "{hier_inter_n:.3g} n between nodes, {factor:.0f}x less, {hier_ms:.2f} ms;\n"
              "- **a ring per NIC**, as NCCL runs its rings (one channel per NIC, each leaving the node "
              "through its own): {rpn_nics_used} NICs busy, {rpn_inter_n:.3g} n each, {rpn_ms:.2f} ms, "
              "NVLink and the NICs busy in the same rounds. For 64 KiB the model charges its "
              "{rpn_rounds} rounds {rpn_small_us:.0f} µs, but that figure queues all {g} rings' "
              "messages through each GPU's one port, {g} α a round. NCCL's channels run at once, each "
              "on its own SMs and connections, so their latencies overlap: one ring alone on its 1/{g} "
              "of the buffer, {channel_small_us:.0f} µs, is closer to what the {g} cost together. "
              "Either way hierarchical's {hier_rounds} rounds, {hier_small_us:.0f} µs, win for small "
              "messages.\n\n"
              "So the single ring is slow because it leaves {idle} NICs idle, not because rings are: "
              "where the bytes go decides. All three send {ring_total_n:.3g} n per rank in all. NCCL also "
              "runs trees between nodes, and on NVSwitch systems NVLS, which adds in the switch."),
        run=slow_links,
        checks=(Check("all three schedules are all-reduces (the simulator's counts)",
                      lambda f: f["ring_correct"] and f["hier_correct"] and f["rpn_correct"]),
                Check("one ring crosses between nodes through 2 NICs; the other two use all of them",
                      lambda f: f["ring_nics_used"] == 2 and f["hier_nics_used"] == f["rpn_nics_used"]
                      == f["nics"]),
                Check("hierarchical sends 2(N-1)/(N g) n between nodes",
                      lambda f: abs(f["hier_inter_n"] - 2 * (f["nodes"] - 1) / (f["nodes"] * f["g"]))
                      < 1e-12),
                Check("all three send the ring's 2(p-1)/p n in total",
                      lambda f: f["ring_total_n"] == f["hier_total_n"] == f["rpn_total_n"]
                      == 2 * (f["p"] - 1) / f["p"]),
                Check("using every NIC is what matters for large messages: both beat one ring by > 4x",
                      lambda f: f["ring_ms"] > 4 * max(f["hier_ms"], f["rpn_ms"])),
                Check("for small messages fewer rounds win: hierarchical beats a ring per NIC, queued or "
                      "with its channels at once",
                      lambda f: f["hier_small_us"] < f["channel_small_us"] < f["rpn_small_us"]
                      and f["hier_rounds"] < f["rpn_rounds"])),
        predict=Predict("One ring over p={p} GPUs in {nodes} nodes of {g}, every GPU with its own NIC: how "
                        "many of the {nics} NICs carry the ring's traffic between the nodes?",
                        "ring_nics_used",
                        misconceptions=(
                            (16, "every GPU has a NIC, but a ring's neighbours are in the same node except "
                                 "where the ring crosses a node boundary"),
                            (1, "the ring closes: it crosses from node 0 to node 1 and back again"))),
        hint="Walk the ring 0 -> 1 -> ... -> 15 -> 0 and mark each step that leaves a node.",
        hints=("Two steps leave a node: 7 -> 8 and 15 -> 0.",),
        try_this="dplab tune --world-sizes 4   # then algorithm='auto' picks per size from what it measured",
        explore=Explore("cost", lambda f: {"p": f["p"]}),
        teaches=("bandwidth-latency",),
        show=(rings_per_nic, "dplab.reference.algorithms.hierarchical.allreduce"),
        inputs={"p": 16, "nodes": 2, "g": 8, "nics": 16, **DGX_GBPS},
    ),
    Step(
        title="busbw against algbw: what nccl-tests reports",
        text=("On a simulated DGX H100 node ({cluster}: {p} H100s, NVLink {link_gbps:g} GB/s each "
              "way per GPU), the ring all-reduces {large:size} in {ring_ms:.3f} ms. nccl-tests "
              "(and `dplab bench`, whose rows these are) report two bandwidths:\n\n- **algbw** = S "
              "/ t, the buffer over the time: {algbw:.0f} GB/s. It is what a user feels, but it "
              "falls as p grows, because every rank must send about 2S whatever p is;\n- **busbw** "
              "= algbw · 2(p-1)/p = algbw · {factor:.3g}: {busbw:.0f} GB/s. The ring sends "
              "2(p-1)/p S per rank, so busbw is the rate each rank's port really moved bytes at, "
              "and the same at any p: it is the number to hold against the link.\n\n{busbw:.0f} "
              "GB/s is below the link's {link_gbps:g}: each of the 2(p-1) rounds pays α, and in "
              "the reduce-scatter's rounds the GPU adds what it received, reading two bytes and "
              "writing one from its HBM (γ). For {small:size} the latencies are the time: busbw "
              "{small_busbw:.1f} GB/s.\n\nbusbw's factor assumes the ring's bytes. NVLS (the "
              "NVSwitch adds: step 10) sends each byte about once, so its busbw, {nvls_busbw:.0f} "
              "GB/s, is above the link's {link_gbps:g}: no law broken, only a yardstick made for "
              "rings."),
        run=bus_and_alg,
        checks=(Check("busbw = algbw · 2(p-1)/p, in dplab bench's rows",
                      lambda f: abs(f["busbw"] - f["algbw"] * f["factor"]) < 1e-9 * f["busbw"]),
                Check("a large ring's busbw is below the link's bandwidth but within 25% of it",
                      lambda f: 0.75 * f["link_gbps"] < f["busbw"] < f["link_gbps"]),
                Check("a 64 KiB all-reduce is latency-bound: busbw below a tenth of the link",
                      lambda f: f["small_busbw"] < f["link_gbps"] / 10),
                Check("NVLS's busbw is above the link's bandwidth",
                      lambda f: f["nvls_busbw"] > f["link_gbps"])),
        predict=Predict("A ring all-reduce of S bytes on p={p} GPUs takes t seconds: algbw = S/t. "
                        "nccl-tests also reports busbw: how many times algbw is it at p={p}?",
                        "factor", rel_tol=0.01, misconceptions=(
                            (1, "busbw equals algbw only at p = 2; at p = 8 each rank sends "
                                "2(p-1)/p bytes for each byte of the buffer"),
                            (2, "2 is where 2(p-1)/p tends as p grows; at p = 8 it is 1.75"),
                            (lambda g, f: g == f["p"], "p times counts every rank's bytes; busbw "
                                                      "is one rank's: 2(p-1)/p"),
                            (0.875, "(p-1)/p is one half, the reduce-scatter; the all-gather sends "
                                    "as much again"))),
        hint="How many bytes does each rank send, per byte of the buffer, in a ring all-reduce? "
             "(step 1)",
        hints=("2(p-1)/p: the reduce-scatter's (p-1)/p and the all-gather's again.",),
        try_this="dplab bench --backend sim --cluster dgx-h100 --world-sizes 8 --algorithms ring "
                 "--sizes 64K,256M",
        teaches=("gpu-collectives",),
        show=("dplab.backends.sim.timing.bench_rows", "dplab.backends.bench.timing.busbw_factor"),
        inputs={"p": 8},
    ),
    Step(
        title="Channels: one ring cannot fill the NICs",
        text=("Two simulated DGX H100 nodes ({cluster}, p={p}): NVLink {link_gbps:g} GB/s inside a "
              "node, one {nic_gbps:g} GB/s NIC per GPU between them. NCCL splits a collective over "
              "several *channels*, each a ring of its own on its share of the buffer; ring j here "
              "leaves each node through local GPU j (step 7's rings, {g} of them or fewer). busbw "
              "for {n:size}, on the simulator:\n\n| channels | busbw |\n|---|---|\n{rows}\n\nOne "
              "ring crosses between the nodes through one NIC each way, so its busbw is that "
              "NIC's: {one:.0f} GB/s of {nic_gbps:g}. Each channel brings its own NIC: {g} "
              "channels give {gain:.1f}x, {eight:.0f} GB/s, where NVLink's share of the rounds "
              "starts to show. That is why NCCL runs several channels (and the sim counts their "
              "messages one by one through each GPU's port).\n\nInside one node the simulator lets "
              "one ring fill a GPU's NVLink port: it prices ports, not the GPU's SMs. On a real "
              "H100 a channel is one thread block, which cannot move bytes at the NVLink's rate by "
              "itself, so NCCL runs many channels inside a node as well: a limit this model leaves "
              "out."),
        run=channels_fill_nics,
        checks=(Check("one channel's busbw is its one NIC's (within 5%)",
                      lambda f: 0.95 * f["nic_gbps"] < f["one"] <= f["nic_gbps"]),
                Check("busbw grows with every channel added, 1 to 8",
                      lambda f: all(f["busbw"][a] < f["busbw"][b]
                                    for a, b in ((1, 2), (2, 4), (4, 8)))),
                Check("8 channels give over 5x one channel's busbw",
                      lambda f: f["gain"] > 5)),
        predict=Predict("One ring (one channel) over {p} GPUs on two DGX H100 nodes: NVLink "
                        "{dgx_nvlink_gbps:.0f} GB/s inside a node, a {dgx_nic_gbps:.0f} GB/s NIC per GPU "
                        "between. Roughly what busbw "
                        "does it reach, in GB/s?",
                        "one", rel_tol=0.1, unit="GB/s", label="simulated on {cluster}",
                        misconceptions=(
                            (lambda g: 350 <= g <= 420,
                             "8 NICs a node, but one ring leaves a node through one of them"),
                            (lambda g: g >= 300,
                             "NVLink is not the bottleneck: the ring must cross between the nodes, "
                             "and it does so through one NIC each way"))),
        hint="Where does one ring cross from node 0 to node 1, and through how many NICs?",
        hints=("Step 7: one ring crosses through 2 of the 16 NICs, one each way between the "
               "nodes.",),
        try_this="dplab bench --backend sim --cluster dgx-h100x2 --world-sizes 16 --algorithms "
                 "ring,hierarchical:8",
        teaches=("gpu-collectives",),
        show=(rings_per_nic, "dplab.backends.sim.timing.schedule_time"),
        inputs={"p": 16, **DGX_GBPS},
    ),
    Step(
        title="Ring, tree and NVLS from 8 to 1,024 GPUs",
        text=("NCCL has three all-reduce algorithms on an H100 cluster: the ring, the double "
              "binary tree and NVLS (NVLink SHARP: the NVSwitch adds, so each GPU sends its data "
              "to the switch once and receives the sum once; across nodes, NVLSTree: the switch in "
              "each node, a tree between them). NVLS is no schedule (the switch is not a rank): "
              "dplab prices it from the cluster file, whose NVSwitch says it adds "
              "(`dplab.reference.nvls`, shown). {n:size} on 1, 8 and 128 DGX nodes, in ms (ring "
              "and tree from the simulator, timing only; the ring at 1,024 from its closed form, "
              "2(p-1) rounds at the NIC's pace, which the simulator equals at 64: {model64:.3f} "
              "ms):\n\n| GPUs | ring | tree | NVLS |\n|---|---|---|---|\n{rows}\n\nThe ring's "
              "2(p-1) latencies grow with p: {ring_1024:.1f} ms at 1,024. The tree's grow with lg "
              "p: {tree_1024:.3f} ms. NVLS pays 2 α inside a node ({nvls_8:.4f} ms at 8, against "
              "the ring's {ring_8:.4f}) and the tree's latencies between nodes, on a piece 1/8 the "
              "size: {nvls_1024:.3f} ms at 1,024. For large buffers inside a node it sends half "
              "the ring's bytes: {big:size} takes ring {big_ring:.2f} ms, tree {big_tree:.2f} ms, "
              "NVLS {big_nvls:.2f} ms. (Across nodes dplab adds NVLSTree's three moves one after "
              "another; NCCL pipelines them, so this is an upper bound.)"),
        run=ring_tree_nvls,
        checks=(Check("the simulator's ring equals its closed form at p = 64",
                      lambda f: abs(f["by_p"][64]["ring"] - f["model64"]) < 1e-6 * f["model64"]),
                Check("the ring's time grows over 100x from 8 to 1,024 GPUs; the tree's under 10x",
                      lambda f: f["by_p"][1024]["ring"] > 100 * f["by_p"][8]["ring"]
                      and f["by_p"][1024]["tree"] < 10 * f["by_p"][8]["tree"]),
                Check("NVLS is the fastest at every p here",
                      lambda f: all(v == "nvls" for v in f["fastest"].values())),
                Check("for 256 MiB in one node NVLS beats the ring, and the ring the tree",
                      lambda f: f["big_nvls"] < f["big_ring"] < f["big_tree"])),
        predict=Predict("At 1,024 GPUs (128 DGX nodes), for {n:size}, which is fastest: ring, tree "
                        "or nvls?",
                        "fastest_1024", choices=("ring", "tree", "nvls"), misconceptions=(
                            ("ring", "the ring's 2(p-1) latencies are 2,046 messages one after "
                                     "another"),
                            ("tree", "the tree's latencies grow only with lg p, but NVLS "
                                     "pays them only between nodes, on a piece 1/8 the size, and 2 "
                                     "α inside each"))),
        hint="Count the latencies: 2(p-1) for the ring, about 2 lg p for the tree.",
        hints=("NVLS needs no rounds inside a node: the switch adds.",),
        try_this=("python -c \"from dplab.reference.nvls import nvls_time; "
                  "print(nvls_time('dgx-h100x4', 32, 1 << 30))\""),
        teaches=("gpu-collectives",),
        show=("dplab.reference.nvls.nvls_time",),
        inputs={"n": MIB},
    ),
)


LESSON = Lesson(2, "allreduce", "The all-reduce: naive, ring, tree and what the engines use",
                "How each all-reduce moves the bytes, what each costs in rounds and bytes, and why topology "
                "matters.", STEPS)
