"""Lesson 1: replicas that stay identical, and why that makes data parallelism large-batch SGD.

    dplab lesson 1

Four steps: train on four ranks and compare with one device; cut a global batch into shards;
leave the all-reduce out and watch the replicas drift; show that the shards' gradients sum to
the one-device gradient of the whole batch.
"""

from __future__ import annotations

import numpy as np

from dplab.backends import allreduce
from dplab.backends.cli.args import build_parser
from dplab.backends.runs.run import RunSpec, run_train
from dplab.lessons.step import Check, Explore, Lesson, Predict, Step
from dplab.reference.data import batch_indices, shard
from dplab.reference.model import MLP
from dplab.reference.train.single import TrainConfig, setup

__all__ = ["LESSON"]


def four_replicas(lab):
    spec = RunSpec(world_size=4, algorithm="ring", train=TrainConfig(steps=50))
    row, events = run_train(spec, world=lab.world(4), trace=True)
    same = row["ranks_identical"]
    return {"p": 4, "steps": row["steps"], "optimizer": spec.train.optimizer.name,
            "cli_optimizer": build_parser().parse_args(["train"]).optimizer,
            "identical": same,
            "diff": row["max_abs_diff_vs_single"],
            "loss": row["final_loss"],
            "events": events,
            "verdict": "identical" if same else "different"}


def _timeline(facts):
    from dplab.viz.timeline import timeline_figure
    return timeline_figure([e for rank in facts["events"] for e in rank], title="4 replicas, 50 steps")


def cut_the_batch(lab):
    p, global_batch = 4, 10
    batch = batch_indices(n=256, global_batch=global_batch, step=0, seed=0)
    shards = [shard(batch, rank, p) for rank in range(p)]
    together = np.concatenate(shards)
    return {"p": p, "B": global_batch,
            "sizes": [len(s) for s in shards],
            "rank0": len(shards[0]),
            "covers": bool(np.array_equal(together, batch))}


def rank_trains_alone(comm, cfg, allreduce_grads):
    model, data, params = setup(cfg)
    grad = np.zeros_like(params)
    B = cfg.global_batch
    for step in range(cfg.steps):
        batch = batch_indices(cfg.num_samples, B, step, cfg.seed)
        idx = shard(batch, comm.rank, comm.world_size)
        grad[:] = 0
        model.loss_and_grad(params, data.x[idx], data.y[idx], 1 / B, grad)
        if allreduce_grads:
            allreduce(comm, grad, algorithm="ring")
        params -= cfg.optimizer.lr * grad
    return params


def drift_without_allreduce(lab):
    cfg, world = TrainConfig(steps=20), lab.world(4)
    alone = world.run(rank_trains_alone, cfg, False)
    together = world.run(rank_trains_alone, cfg, True)

    def spread(replicas):
        return float(max(np.abs(p - replicas[0]).max() for p in replicas))

    return {"drift": spread(alone), "together": spread(together)}


def shards_sum_to_one_batch(lab):
    cfg, p, B = TrainConfig(), 4, 10
    model, data, params = setup(cfg)
    idx = batch_indices(cfg.num_samples, B, step=0, seed=0)

    def gradient(samples, scale):
        g = np.zeros_like(params)
        model.loss_and_grad(params, data.x[samples], data.y[samples], scale, g)
        return g

    shards = [shard(idx, r, p) for r in range(p)]
    scale = 1 / len(idx)  # the global batch's size, on every rank
    one_device = gradient(idx, scale)
    # what the all-reduce adds:
    summed = sum(gradient(s, scale) for s in shards)
    by_shard = sum(gradient(s, 1 / len(s)) for s in shards) / p
    return {"p": p, "B": B, "last": p - 1,
            "last_shard": len(shards[-1]),
            "sizes": ", ".join(str(len(s)) for s in shards),
            "diff": float(np.abs(summed - one_device).max()),
            "scale": scale,
            "wrong": float(np.abs(by_shard - one_device).max()),
            "params": MLP(cfg.model).num_params}


STEPS = (
    Step(
        title="One model, four replicas",
        text=("Can {p} workers, each seeing only a quarter of every batch, train the very model one "
              "device would? A **rank** is one worker: one process (on a cluster, one GPU), numbered 0 to "
              "p-1, where p "
              "is the world size. Here p = {p} ranks each hold a full copy of the model (a **replica**) and "
              "train it for {steps} steps, each on its own part of every batch. After every backward pass "
              "an **all-reduce** runs: every rank puts in its gradient, and every rank gets back the sum of "
              "all p of them. Then every rank takes the same optimizer step.\n\n"
              "At the end the four replicas are identical to the bit ({identical}): they started from "
              "rank 0's weights and applied the same summed gradient, bit for bit, every step. Against one "
              "device trained on the same batches they differ by at most **{diff:.1e}**: float64 rounding, "
              "because the all-reduce adds in another order than one device does. Final loss {loss:.4f} "
              "(`dplab train --world-size 4` ends at another loss: it steps with {cli_optimizer}, "
              "this run with the library's default, {optimizer}).\n\n"
              "The code below is the recipe at its plainest (`reference/train/naive.py`): broadcast, "
              "shard, forward and backward, one all-reduce of the whole gradient, step. The run above is "
              "its bucketed form (`reference/train/sync.py`, what `dplab train` runs), which all-reduces "
              "the gradient bucket by bucket while backward still runs, and steps to the same bits "
              "when it has one bucket."),
        run=four_replicas,
        checks=(Check("every replica holds the same bits", lambda f: f["identical"] is True),
                Check("the replicas equal one device to float64 rounding (< 1e-12)",
                      lambda f: f["diff"] < 1e-12)),
        figure=_timeline,
        predict=Predict("After {steps} steps on {p} ranks, are the replicas 'identical', 'close' or "
                        "'different' from each other?", "verdict",
                        choices=("identical", "close", "different"),
                        misconceptions=(
                            ("close", "close is how they compare with one device (another order of "
                                      "additions); with each other they are bitwise equal, because every "
                                      "rank gets the very same sum from the all-reduce"),
                            ("different", "each rank sees different samples, but it steps on the summed "
                                          "gradient of all of them, the same on every rank"))),
        hint="Every rank starts from rank 0's weights: the first thing the recipe does is broadcast them.",
        hints=("And every step it applies the same update: the all-reduce hands every rank the same sum.",),
        show=("dplab.reference.train.naive.train_naive",),
        inputs={"p": 4, "steps": 50},
        try_this="dplab train --world-size 4 --algorithm tree --trace run.json   # then open it in the app",
        explore=Explore("training", lambda f: {"world_sizes": f["p"], "steps": f["steps"]}),
        teaches=("replicas",),
    ),
    Step(
        title="Sharding the global batch",
        text=("A global batch of B={B} samples on p={p} ranks: each rank takes a contiguous shard, "
              "the first B mod p ranks one sample more. Shard sizes: {sizes}. Together they are "
              "exactly the global batch ({covers}): global batch = per-rank batch × p when B divides "
              "evenly, and uneven shards are fine."),
        run=cut_the_batch,
        checks=(Check("the shards together are the global batch", lambda f: f["covers"]),
                Check("shard sizes differ by at most one", lambda f: max(f["sizes"]) - min(f["sizes"]) <= 1),
                Check("the shard sizes add up to B", lambda f: sum(f["sizes"]) == f["B"])),
        predict=Predict("A global batch of {B} samples on {p} ranks: how many samples does rank 0 get?",
                        "rank0", misconceptions=(
                            (2, "{B} // {p} = 2 is what every rank gets at least; the B mod p samples "
                                "left over go one each to the first ranks"),
                            (2.5, "a shard holds whole samples: no rank gets half of one"))),
        hint="10 = 4 × 2 + 2: how many samples are left over when every rank has taken 2?",
        hints=("The first B mod p ranks take one sample more than the others.",),
        show=("dplab.reference.data.shard", "dplab.reference.schedule.chunk_bounds"),
        inputs={"p": 4, "B": 10},
        try_this="dplab train --world-size 3 --global-batch 10   # uneven shards, still equal to one device",
        teaches=("sharding",),
    ),
    Step(
        title="Why every replica must stay identical",
        text=("Leave the all-reduce out and each rank steps on its own shard's gradient: after 20 steps "
              "the replicas differ by up to **{drift:.3g}** - four different models, none of them the one "
              "a single device would train. With the all-reduce they differ by {together:.1g}: the sum "
              "makes every rank's update the same, so the replicas never need to be compared."),
        run=drift_without_allreduce,
        checks=(Check("without the all-reduce the replicas drift apart (> 1e-3)",
                      lambda f: f["drift"] > 1e-3),
                Check("with it they stay bitwise identical", lambda f: f["together"] == 0.0)),
        hint="The all-reduce is the only line that differs between the two runs.",
        show=(rank_trains_alone,),
        try_this="Change the step's run to all-reduce only every 5th step (local SGD) and compare the drift.",
        teaches=("replicas",),
    ),
    Step(
        title="Data parallelism is large-batch SGD",
        text=("Each rank scales its loss by 1/B with B the *global* batch (1/{B} = {scale}), not by its "
              "shard size, nor by 1/p as torch's DistributedDataParallel does (it averages the summed "
              "gradients over the ranks, which is the same only when every shard has B/p samples). "
              "Then the shard gradients simply **sum** to one device's gradient of the whole batch: "
              "they differ by {diff:.1e}. Averaging per-shard means instead (each scaled by 1/its size) is "
              "off by {wrong:.2g} when the shards are uneven. So p ranks with shards of b samples train "
              "exactly like one device with a batch of p·b: the learning rate belongs to that batch."),
        run=shards_sum_to_one_batch,
        checks=(Check("the summed shard gradients equal the full-batch gradient (< 1e-14)",
                      lambda f: f["diff"] < 1e-14),
                Check("averaging per-shard means is wrong for uneven shards (> 1e-6)",
                      lambda f: f["wrong"] > 1e-6)),
        predict=Predict("A global batch of {B} samples on {p} ranks: rank {last} holds {last_shard} of them. "
                        "By what factor does rank {last} scale its loss, so that the ranks' gradients sum "
                        "to one device's gradient of the whole batch?",
                        "scale", rel_tol=1e-9, misconceptions=(
                            (lambda g, f: abs(g - 1 / f["p"]) < 1e-9,
                             "1/p is torch DDP's convention: it averages the summed gradients over the p "
                             "ranks, which equals the batch mean only when every shard is the same size; "
                             "here they hold {sizes} samples"),
                            (lambda g, f: abs(g - 1 / f["last_shard"]) < 1e-9,
                             "1/{last_shard} is rank {last}'s own mean: its samples would weigh more than "
                             "rank 0's, whose shard is larger"),
                            (lambda g, f: abs(g - f["B"]) < 1e-9,
                             "the factor multiplies the loss: a mean over B samples divides by B"))),
        hint="The scale is the same on every rank, whatever its shard size.",
        hints=("One device would take the mean over the whole batch: it divides the summed loss by B.",),
        inputs={"p": 4, "B": 10, "last": 3, "last_shard": 2},
        try_this="dplab compare --world-sizes 1,2,3,4   # every row ends within rounding of one device",
        teaches=("large-batch-sgd",),
    ),
)


LESSON = Lesson(1, "replicas", "Replicas that stay identical",
                "Why data-parallel training on N ranks is the same as large-batch SGD on one device.", STEPS)
