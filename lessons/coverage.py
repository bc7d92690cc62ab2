"""The ideas of data parallelism every learner should meet, and which step teaches each.

    python -m dplab.lessons.coverage      # lessons/README.md's table, generated from the steps

A step names what it teaches (``Step(teaches=("replicas",))``); CI fails when an idea has no
step, when a step names an idea not listed here, or when lessons/README.md's table is not this one.
"""

from __future__ import annotations

from dplab.lessons import lessons

__all__ = ["CONCEPTS", "coverage", "coverage_table"]

CONCEPTS = {
    "replicas": "replicas, and why every replica must stay identical",
    "sharding": "sharding the global batch (global = micro × N, uneven shards)",
    "large-batch-sgd": "data parallelism equals large-batch SGD",
    "allreduce": "the all-reduce: naive, ring, tree and the others in the engine",
    "bandwidth-latency": "the bandwidth/latency trade-off, and topology",
    "cost-model": "the α-β-γ cost model against measurements",
    "buckets": "buckets and overlap with backward",
    "accumulation": "gradient accumulation",
    "amdahl": ("scaling: T(p) = T_comp/p + T_comm(p), where Amdahl's law misleads, the "
               "communication-to-computation ratio, measured scaling efficiency"),
    "lr-scaling": "learning-rate scaling, warm-up, LARS/LAMB",
    "sync-async": "synchronous vs asynchronous training",
    "staleness": "staleness and bounded staleness (SSP)",
    "stragglers": "stragglers and backup workers",
    "faults": "faults: checkpoints, exact resume, a lost worker",
    "memory": "memory: replicas vs ZeRO-1/2/3/FSDP, the 7B example",
    "precision": "mixed precision and loss scaling",
    "dp-vs-ddp": "DataParallel (one process, a master device) vs DistributedDataParallel",
    "engines": "the engines (MPI, NCCL, gloo), their launchers, and running past one machine",
    "beyond-dp": "when data parallelism is not enough: model, pipeline, tensor parallelism",
    "batch-size": ("batch-size economics: strong vs weak scaling, the gradient noise scale and "
                   "critical batch, held-out loss, where lr scaling rules break"),
    # lesson 14
    "real-model": ("a real model: a transformer's FLOPs per token (6 N), tokens/s, model FLOPs "
                   "utilisation and where its step time goes, with DDP and FSDP"),
    # lesson 15
    "torch-stack": ("the real PyTorch stack: DDP from hooks on torch tensors, DistributedSampler "
                    "(set_epoch, padding) against weighted uneven shards, SyncBatchNorm"),
    "compression": ("cutting communication: gradient compression (fp16, bf16, PowerSGD hooks) and "
                    "local SGD, in bytes and loss"),
    # lessons 10 and 11
    "activations": ("activation memory beside the model states, and activation checkpointing "
                    "(recompute for memory)"),
    "bf16": "bfloat16 against float16: range against precision, and why bf16 needs no loss scaling",
    # what issue 31's teacher found missing
    "ddp-internals": ("torch DDP's internals (Li et al., VLDB 2020): buckets rebuilt from the "
                      "first backward's order, unused parameters and static_graph, buffers "
                      "broadcast every forward"),
    "async-efficiency": ("asynchronous SGD's statistical efficiency: loss against samples seen, "
                         "and what a gradient's delay costs per sample"),
    "gpu-collectives": ("GPU collectives on a simulated cluster: busbw against algbw, NCCL's "
                        "channels, ring, tree and NVLS from 8 to 1,024 GPUs"),
    "fsdp-overlap": ("overlap in FSDP/ZeRO-3: prefetching the next unit's all-gather, "
                     "reshard_after_forward, HSDP"),
    # issue 31's items 3 and 6 (lessons 10 and 13)
    "grad-clipping": ("gradient clipping by the global norm under ZeRO/FSDP: one all-reduce of the "
                      "shards' squared norms"),
    "batch-ramp": ("batch-size warm-up: increasing the batch instead of decaying the lr (Smith et "
                   "al. 2018), as GPT-3 ramps it"),
    # issue 31's idea 7 (lesson 14)
    "profiling": ("profiling one step: torch.profiler's operations beside dplab's own trace, both "
                  "as Chrome traces"),
}


def coverage() -> dict[str, list[tuple[int, int, str]]]:
    """concept -> [(lesson number, step number (1-based), step title), ...]."""
    taught: dict[str, list[tuple[int, int, str]]] = {key: [] for key in CONCEPTS}
    for lesson in lessons():
        for k, step in enumerate(lesson.steps, start=1):
            for key in step.teaches:
                taught.setdefault(key, []).append((lesson.number, k, step.title))
    return taught


def coverage_table() -> str:
    """lessons/README.md's concept -> lesson/step table (markdown)."""
    lines = ["| idea | taught in (lesson.step) |", "|---|---|"]
    for key, places in coverage().items():
        where = "; ".join(f"{n}.{k} {title}" for n, k, title in places) or "-"
        lines.append(f"| {CONCEPTS.get(key, key)} | {where} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(coverage_table())
