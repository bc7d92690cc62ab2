"""Lesson 2: the all-reduce - naive, ring, tree, and the schedules the engines use.

    dplab lesson 2

Five steps: count the bytes rank 0 really sends in a ring all-reduce (from a real run's trace);
write the ring's reduce-scatter yourself (the exercise); compare every schedule's rounds and
bytes; price the trade-off between the two with the alpha-beta model; and see why a cluster
reduces hierarchically (bytes on the slow links between nodes).
"""

from __future__ import annotations

import numpy as np

from dplab.backends import allreduce
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.algorithms import allreduce_schedule, ring
from dplab.reference.costfit import terms
from dplab.reference.costmodel import cost
from dplab.reference.pictures import render_rounds
from dplab.reference.simulate import is_allreduce, simulate
from dplab.reference.topology import PRESETS

__all__ = ["LESSON"]

MIB = 1 << 20
# what the table compares: the three textbook schedules, then those the engines use
ALGORITHMS = ("naive", "ring", "tree", "recursive_doubling", "rabenseifner", "double_tree", "hierarchical:4")


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
            "formula": 2 * (p - 1) * n // p,
            "naive_root": (p - 1) * n,
            "all_sent": [r["bytes"] for r in ranks],
            "sum": ranks[0]["value"],
            "expected_sum": float(sum(range(1, p + 1)))}


def _ring_figure(facts):
    from dplab.viz.collectives import CollectiveConfig, walkthrough
    from dplab.viz.collectives_figure import figure
    return figure(walkthrough(CollectiveConfig("allreduce", "ring", world_size=facts["p"], n=8)))


def ring_reduce_scatter_rounds(lab):
    p = 4
    # the engine's own: what your exercise must match
    schedule = ring.reduce_scatter(p)
    rounds = schedule.rounds
    # [rank, chunk, contributor]: times counted
    end = simulate(schedule).holdings[-1]
    rule = all(t.chunk == (t.src - k - 1) % p and t.dst == (t.src + 1) % p
               for k, rnd in enumerate(rounds) for t in rnd)
    complete = all((end[r, r] == 1).all() for r in range(p))
    rank0_next = next(t.chunk for t in rounds[1] if t.src == 0)
    return {"p": p, "last": p - 1,
            "rounds": len(rounds),
            "picture": render_rounds(schedule),
            "rule": rule,
            "own_chunk_complete": complete,
            "round1_rank0_chunk": rank0_next}


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
    return {"p": p, "rows": rows, "by": by, "table": table,
            "fewest_alphas": fewest}


def _tree_figure(facts):
    from dplab.viz.collectives import CollectiveConfig, walkthrough
    from dplab.viz.collectives_figure import figure
    return figure(walkthrough(CollectiveConfig("allreduce", "tree", world_size=facts["p"], n=8)))


def latency_or_bandwidth(lab):
    # 10 Gb/s Ethernet, 5 us a message
    p, net = 8, PRESETS["flat-10g"]
    small, large = 4 << 10, 64 * MIB
    rd = "recursive_doubling"
    times = {(a, n): cost(allreduce_schedule(a, p), n, itemsize=4,
                          topology=net).time
             for a in ("ring", rd) for n in (small, large)}
    alpha = net.intra.alpha
    return {"p": p, "small": small, "large": large,
            "alpha_us": alpha * 1e6,
            "gbps": 1e-9 / net.intra.beta,
            "ring_small_us": times["ring", small] * 1e6,
            "rd_small_us": times[rd, small] * 1e6,
            "ring_large_ms": times["ring", large] * 1e3,
            "rd_large_ms": times[rd, large] * 1e3,
            "ring_alpha_share": 2 * (p - 1) * alpha / times["ring", small],
            "small_winner": min(("ring", rd), key=lambda a: times[a, small]),
            "large_winner": min(("ring", rd), key=lambda a: times[a, large])}


def slow_links(lab):
    # two nodes of 8 GPUs
    topo, p, n = PRESETS["dgx-h100"], 16, 256 * MIB
    g = topo.ranks_per_node
    out = {"p": p, "g": g, "nodes": p // g, "n_mib": n // MIB}
    for key, name in (("ring", "ring"), ("hier", f"hierarchical:{g}")):
        schedule = allreduce_schedule(name, p)
        t, chunk = schedule.table, n // schedule.num_chunks
        # this transfer leaves its node:
        between = (t.src // g) != (t.dst // g)
        inter = np.bincount(t.src[between], minlength=p).max()
        total = np.bincount(t.src, minlength=p).max()
        secs = cost(schedule, n, itemsize=4, topology=topo).time
        out[f"{key}_inter_n"] = int(inter) * chunk / n
        out[f"{key}_total_n"] = int(total) * chunk / n
        out[f"{key}_ms"] = secs * 1e3
        out[f"{key}_rounds"] = len(schedule.rounds)
    out["factor"] = out["ring_inter_n"] / out["hier_inter_n"]
    return out


STEPS = (
    Step(
        title="Bytes on the wire: a real ring all-reduce",
        text=("Four ranks all-reduce {n_bytes:,} bytes (1 MiB of float32) with the ring, the trace on. "
              "Rank 0 sent **{sent:,} bytes** in {messages} messages, exactly 2(p-1)/p of the buffer "
              "({formula:,}), and so did every rank ({all_sent}). The ring cuts the buffer into p chunks: "
              "p-1 rounds of reduce-scatter, each passing one chunk to the right neighbour, who adds it; "
              "then p-1 rounds of all-gather, passing the finished chunks on. Every element ends as "
              "1+2+3+4 = {sum:g}. The naive way (everyone sends to rank 0, which sends the sum back) "
              "makes rank 0 send {naive_root:,} bytes: p-1 whole buffers."),
        run=ring_bytes,
        checks=(Check("rank 0 sends 2(p-1)/p · n bytes ({formula:,})", lambda f: f["sent"] == f["formula"]),
                Check("in 2(p-1) messages, one chunk per round", lambda f: f["messages"] == 2 * (f["p"] - 1)),
                Check("every rank sends the same", lambda f: len(set(f["all_sent"])) == 1),
                Check("every element holds the sum 1+...+p", lambda f: f["sum"] == f["expected_sum"])),
        figure=_ring_figure,
        predict=Predict("How many bytes does rank 0 send in a ring all-reduce of {n_bytes:,} bytes "
                        "(1 MiB) at p={p}?", "sent", unit="bytes"),
        hint="Two phases, p-1 rounds each, one chunk of n/p bytes per round: 2(p-1) · n/p.",
        try_this="dplab train --world-size 4 --algorithm ring --trace run.json   # every send is traced",
        explore=Explore("collectives", lambda f: {"algorithm": "ring", "p": f["p"], "n": 8}),
        teaches=("allreduce",),
    ),
    Step(
        title="Exercise: the ring reduce-scatter, round by round",
        text=("Now write it yourself. `dplab lesson init DIR` copies the exercise stubs into DIR; fill in "
              "`ring_reduce_scatter(p) -> Schedule` and run `dplab lesson check 2 DIR`: it runs your "
              "schedule in the simulator and says what is wrong in the lesson's words (which rank holds "
              "which chunk counted how many times, after which round).\n\n"
              "Here is the engine's own ring reduce-scatter at p={p}, drawn by the simulator "
              "({rounds} rounds; `a01` is chunk a holding rank 0's and rank 1's parts). In round k, rank r "
              "sends chunk (r-k-1) mod p to rank r+1, which adds it (`{rule}`); after p-1 rounds rank r "
              "holds chunk r with every rank's part counted exactly once (`{own_chunk_complete}`).\n\n"
              "```\n{picture}\n```"),
        run=ring_reduce_scatter_rounds,
        checks=(Check("every transfer follows the rule: chunk (r-k-1) mod p to rank r+1",
                      lambda f: f["rule"]),
                Check("rank r ends holding chunk r, each contribution once",
                      lambda f: f["own_chunk_complete"]),
                Check("p-1 rounds", lambda f: f["rounds"] == f["p"] - 1)),
        predict=Predict("At p={p}, which chunk (a number, 0 to {last}) does rank 0 send in round 1, the "
                        "second round?", "round1_rank0_chunk"),
        hint="Round k = 1, rank r = 0: (0 - 1 - 1) mod 4. It is the chunk rank 3 sent to rank 0 in round 0.",
        try_this="dplab lesson init ex && dplab lesson check 2 ex   # then edit ex/ until the check passes",
        explore=Explore("collectives", lambda f: {"collective": "reduce_scatter", "algorithm": "ring",
                                                  "p": f["p"], "n": 8}),
        exercise="ring_reduce_scatter",
        teaches=("allreduce",),
    ),
    Step(
        title="Naive, ring, tree and the others: rounds against bytes",
        text=("Every all-reduce in the engine is a schedule, and the simulator proves each one correct "
              "(every chunk on every rank holds each contribution exactly once). At p={p}, per schedule: "
              "its rounds, the messages on its critical path (each costs a latency α) and the bytes its "
              "busiest rank sends (n = the buffer):\n\n"
              "| algorithm | rounds | α on the path | busiest rank sends |\n|---|---|---|---|\n{table}\n\n"
              "No schedule wins both columns. The ring (and Rabenseifner, and the hierarchical ring) send "
              "the least, 2(p-1)/p n, the minimum for any all-reduce; recursive doubling needs the fewest "
              "latencies, lg p, but sends the whole buffer in each round. The tree does lg p rounds up and "
              "lg p down. Naive has only 2 rounds, but its root receives p-1 whole buffers in the first, one "
              "after the other through its one port: 2(p-1) latencies, like the ring, and the most bytes."),
        run=schedules_compared,
        checks=(Check("the simulator proves every schedule an all-reduce",
                      lambda f: all(r["correct"] for r in f["rows"])),
                Check("the ring sends 2(p-1)/p n, the least of all",
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
                Check("the latency count of the ring is 2(p-1)",
                      lambda f: f["by"]["ring"]["alphas"] == 2 * (f["p"] - 1))),
        figure=_tree_figure,
        predict=Predict("At p={p}, which schedule pays the fewest latencies (α) on its critical path?",
                        "fewest_alphas", choices=ALGORITHMS),
        hint="Each round of recursive doubling doubles how many ranks' parts every rank holds.",
        try_this="dplab app   # Collectives page: pick an algorithm, press Play, watch the bytes counter",
        explore=Explore("collectives", lambda f: {"algorithm": "tree", "p": f["p"], "n": 8}),
        teaches=("allreduce",),
    ),
    Step(
        title="The trade-off: latency or bandwidth",
        text=("Time = α per message on the critical path + β per byte. On 10 Gb/s Ethernet "
              "(α = {alpha_us:g} µs, {gbps:g} GB/s) at p={p}:\n\n"
              "- **{small:,} bytes**: ring {ring_small_us:.1f} µs, recursive doubling {rd_small_us:.1f} µs. "
              "The ring's 2(p-1) latencies are {ring_alpha_share:.0%} of its time: small messages are "
              "latency-bound, and fewer rounds win ({small_winner}).\n"
              "- **{large:,} bytes**: ring {ring_large_ms:.1f} ms, recursive doubling {rd_large_ms:.1f} ms. "
              "Now the bytes dominate, and sending less wins ({large_winner}).\n\n"
              "That is why NCCL and MPI switch algorithms by message size (lesson 3 measures where)."),
        run=latency_or_bandwidth,
        checks=(Check("small messages: recursive doubling beats the ring",
                      lambda f: f["rd_small_us"] < f["ring_small_us"]),
                Check("large messages: the ring beats recursive doubling",
                      lambda f: f["ring_large_ms"] < f["rd_large_ms"]),
                Check("the ring's small message is mostly latency (> 50%)",
                      lambda f: f["ring_alpha_share"] > 0.5)),
        predict=Predict("At p={p} on 10 Gb/s Ethernet, which is faster for a {small:,}-byte all-reduce: "
                        "'ring' or 'recursive_doubling'?", "small_winner",
                        choices=("ring", "recursive_doubling")),
        hint="14 latencies of 5 µs is 70 µs; 4 KiB at 1.25 GB/s is about 3 µs.",
        try_this="dplab app   # Cost page: move α and β and watch the crossover move",
        explore=Explore("cost", lambda f: {"p": f["p"], "alpha_us": f["alpha_us"], "beta_gbps": 1.0}),
        teaches=("bandwidth-latency",),
    ),
    Step(
        title="Topology: keep the bytes off the slow links",
        text=("A cluster is two kinds of link: GPUs in a node talk over NVLink (450 GB/s each way on a DGX "
              "H100), nodes over InfiniBand (50 GB/s). At p={p} ({nodes} nodes of {g}), all-reducing "
              "{n_mib} MiB:\n\n"
              "- the **ring** crosses a node boundary at two ranks, which send their whole share, "
              "{ring_inter_n:.3g} n, over the slow link: {ring_ms:.2f} ms in the model;\n"
              "- the **hierarchical** all-reduce reduce-scatters inside each node, all-reduces across "
              "nodes only a 1/{g} piece, and all-gathers inside again: its busiest rank sends "
              "{hier_inter_n:.3g} n between nodes, {factor:.0f}x less, and takes {hier_ms:.2f} ms.\n\n"
              "Both send {ring_total_n:.3g} n in all; only where the bytes go differs."),
        run=slow_links,
        checks=(Check("hierarchical sends 2(N-1)/(N g) n between nodes",
                      lambda f: abs(f["hier_inter_n"] - 2 * (f["nodes"] - 1) / (f["nodes"] * f["g"]))
                      < 1e-12),
                Check("both send the ring's 2(p-1)/p n in total",
                      lambda f: f["ring_total_n"] == f["hier_total_n"] == 2 * (f["p"] - 1) / f["p"]),
                Check("hierarchical is faster on the cluster", lambda f: f["hier_ms"] < f["ring_ms"]),
                Check("and takes fewer rounds", lambda f: f["hier_rounds"] < f["ring_rounds"])),
        predict=Predict("p={p} ranks in {nodes} nodes of {g}: how many times fewer bytes does the busiest "
                        "rank send between nodes with the hierarchical all-reduce than with the ring?",
                        "factor", rel_tol=0.01),
        hint="The ring's boundary ranks send 2(p-1)/p n across; hierarchical sends 2(N-1)/N of an n/g piece.",
        try_this="dplab tune --world-sizes 4   # then algorithm='auto' picks per size from what it measured",
        explore=Explore("cost", lambda f: {"p": 16}),
        teaches=("bandwidth-latency",),
    ),
)


LESSON = Lesson(2, "allreduce", "The all-reduce: naive, ring, tree and what the engines use",
                "How each all-reduce moves the bytes, what each costs in rounds and bytes, and why topology "
                "matters.", STEPS)
