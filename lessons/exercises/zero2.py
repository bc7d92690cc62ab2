"""Exercise of lesson 10: a ZeRO-2 step, written by the learner, judged on values, bytes and memory.

    dplab lesson check 10 DIR         # runs DIR/zero2_step.py on local worlds of 1..4 ranks

The learner's ``zero2_step(comm, backward, params, shard, optimizer)`` runs on every rank for one
step. ``backward`` (``reference/zero/layers.py``) yields ``(layer, g)``, last layer first, each
``g`` a fresh buffer of this rank's gradient; ZeRO-2 reduce-scatters it at once, keeps its chunk
in ``shard[layer]`` and drops the buffer, and after backward steps its chunks and all-gathers each
layer's weights. Judged on every rank, every step, at p = 1..4:

- values: every chunk against one device (``train_single``, the oracle);
- bytes: the collectives called and bytes sent, against a reduce-scatter and an all-gather per
layer;
- memory: the step's peak allocation (``tracemalloc``), against ZeRO-2's two layers in flight.

An all-reduce instead of the reduce-scatter (1.5x the bytes), ZeRO-1's reduce-after-backward
(the whole gradient held) and a reduce-scatter during backward whose returned view is kept (every
buffer held: told apart from ZeRO-1's by when the reduce-scatters were called, counted against the
layers backward had yielded) all train right, and all fail, named.
"""

from __future__ import annotations

import base64
import signal
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

# the schedules, which collectives imports at its first call: imported before any step is
# measured, so that no module's import counts as memory the learner's step held
import dplab.reference.algorithms  # noqa: F401
from dplab.lessons.exercises.child import dplab_functions, patched_since, run_learner
from dplab.lessons.exercises.learner import Fail, load_function, same_process
from dplab.lessons.exercises.ranks import run_ranks, stop_before
from dplab.lessons.exercises.traffic import Traffic
from dplab.reference.data import batch_indices, shard
from dplab.reference.errors import DplabError
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig, make_optimizer
from dplab.reference.schedule import chunk_bounds
from dplab.reference.train.single import TrainConfig, setup, train_single
from dplab.reference.zero.layers import layer_delta, layer_forward, layer_grads, output_delta
from dplab.reference.zero.traffic import collective_sent

__all__ = ["judge_zero2", "collect_zero2", "backward_layers", "ShardOptimizer", "ShardError",
           "WORLD_SIZES", "STEPS", "MODEL", "HINTS", "ALLOWED_SHARE", "in_flight_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 3
TIMEOUT_S = 10.0  # a collective that some rank never calls fails after this long, naming the rank
_RTOL = 1e-10  # float64 against one device: rounding only
# sixteen layers (544, 14 x 1,056, 132 parameters): the whole gradient is 14x the largest layer,
# and a batch of 8 keeps backward's own deltas (8 x 32 values) small beside a layer
MODEL = MLPConfig(in_dim=16, hidden=(32,) * 15, out_dim=4)
# momentum, not Adam: Adam's step hardly changes when a gradient is p times too large
_CFG = TrainConfig(
    model=MODEL, global_batch=8, steps=STEPS, optimizer=OptimConfig("momentum", lr=0.05)
)
# another algorithm than the ring may send a little more;
# an all-reduce sends 1.5x
_BYTES_SLACK = 1.2
# the peak a step may allocate: ZeRO-2 holds a few layers at a time (the one being reduced, the one
# backward computes, its matmul's scratch, the executor's chunk copies: about 30% here at p=4);
# keeping every layer's buffer holds the whole gradient (100% and more)
ALLOWED_SHARE = 0.5

HINTS = (
    "Each rank needs only its own chunk of each layer's summed gradient: which collective leaves "
    "exactly that, and when can it start?",
    "Inside `for layer, g in backward:` reduce-scatter g at once (reduce_scatter(comm, g)); its "
    "chunk chunk_bounds(len(g), p)[rank] is then the sum. Copy it into shard[layer][:] and `del g` "
    "before the loop asks for the next layer.",
    "After the loop: for each layer, a, b = chunk_bounds(len(w), p)[rank]; optimizer.step(layer, "
    "w[a:b], shard[layer]); allgather(comm, w). An all-reduce would send 1.5x; keeping the buffers "
    "would hold the whole gradient.",
)


class ShardError(DplabError):
    """The learner stepped a rank's shard optimizer with something other than its chunk of a
    layer."""


class ShardOptimizer:
    """Rank ``rank``'s optimizer: state for its own chunk of every layer only, as ZeRO keeps it.

    ``step(layer, params_chunk, grad_chunk)`` updates ``params_chunk`` in place (a view such as
    ``w[a:b]``); anything but this rank's chunk's length is refused with the reason."""

    def __init__(self, cfg: OptimConfig, sizes: list[int], rank: int, world_size: int,
                 dtype: np.dtype) -> None:
        self.rank, self.sizes = rank, sizes
        self.own = [chunk_bounds(n, world_size)[rank] for n in sizes]
        self._opt = [make_optimizer(cfg, b - a, dtype) for a, b in self.own]

    def step(self, layer: int, params: np.ndarray, grad: np.ndarray) -> None:
        if not 0 <= layer < len(self.sizes):
            raise ShardError(f"there is no layer {layer}: the model has layers "
                             f"0..{len(self.sizes) - 1}")
        a, b = self.own[layer]
        if len(params) != b - a or len(grad) != b - a:
            raise ShardError(f"rank {self.rank}'s optimizer holds state for its own chunk of layer "
                             f"{layer} only: {b - a} of its {self.sizes[layer]} parameters "
                             f"(w[{a}:{b}]), but step got {len(params)} parameters and {len(grad)} "
                             "gradients: in ZeRO-2 a rank updates only the chunk it owns, "
                             "chunk_bounds(len(w), p)[rank]")
        self._opt[layer].step(params, grad)


def in_flight_bytes(sizes: list[int], itemsize: int = 8) -> int:
    """The most a ZeRO-2 step may allocate on top of what it started with: ``ALLOWED_SHARE`` of the
    whole gradient, which a few layers in flight never reach and the whole gradient exceeds."""
    return int(ALLOWED_SHARE * itemsize * sum(sizes))


def backward_layers(model: MLP, layers: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                    scale: float) -> Iterator[tuple[int, np.ndarray]]:
    """Run the forward now; return the backward pass one layer at a time, last first:
    ``(layer, g)``, each ``g`` a fresh buffer. The forward's activations exist before the step is
    measured (they are activation memory, not gradient memory);
    the backward drops its own reference to a buffer before it makes the next, so what stays alive
    is what the caller keeps."""
    acts = [x]
    for layer, w in enumerate(layers):
        acts.append(layer_forward(model, layer, w, acts[-1]))
    return _backward(model, layers, acts, output_delta(model, acts[-1], y, scale))


def _backward(model: MLP, layers: list[np.ndarray], acts: list[np.ndarray],
              delta: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for layer in reversed(range(len(layers))):
        g = np.zeros(len(layers[layer]), dtype=layers[layer].dtype)
        layer_grads(model, layer, acts[layer], delta, g)
        if layer:
            delta = layer_delta(model, layer, layers[layer], acts[layer], delta)
        yield layer, g
        del g


def judge_zero2(file: Path, output: list[str]) -> str:
    """The learner's zero2_step on 1..4 ranks: values against one device, bytes sent, peak
    memory."""
    answer = run_learner("zero2_step", file, {"world_sizes": list(WORLD_SIZES)}, output)
    oracle = [train_single(replace(_CFG, steps=k)).params for k in range(STEPS + 1)]
    net = MLP(MODEL)
    sizes = [s.stop - s.start for s in (net.layer_slice(i) for i in range(net.num_layers))]
    for p, run in zip(WORLD_SIZES, answer["data"].get("runs", [])):
        ranks = [[_decode(a) for a in rank["after"]] for rank in run]
        shapes_ok = all(
            len(r) == STEPS and all(a.shape == oracle[0].shape for a in r) for r in ranks
        )
        if len(ranks) != p or not shapes_ok:
            raise Fail(f"at p={p}: the ranks did not bring back {STEPS} steps of {len(oracle[0])} "
                       "parameters each")
        problem = (_too_many_bytes(run, sizes, p) or _too_much_memory(run, sizes, p)
                   or _diagnose(ranks, oracle, sizes, p, run))
        if problem:
            raise Fail(f"at p={p}: {problem}")
    if answer["fail"]:
        raise Fail(answer["fail"])
    n, p = sum(sizes), WORLD_SIZES[-1]
    peak = max(max(rank["peak"]) for run in answer["data"]["runs"] for rank in run)
    return (f"right on 1..{p} ranks: after each of {STEPS} steps every rank holds every chunk as "
            f"one device has it; one reduce-scatter and one all-gather per layer ({n:,} parameters "
            f"in {len(sizes)} layers), and a peak of at most {_kib(peak)} KiB in a step against "
            f"{_kib(8 * n)} KiB for the whole gradient")


def _decode(text: Any) -> np.ndarray:
    """A rank's parameters, sent as the base64 of their float64 bytes (a tenth of JSON's lists)."""
    try:
        return np.frombuffer(base64.b64decode(str(text)), dtype=np.float64)
    except ValueError:
        return np.zeros(0)


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def _too_many_bytes(run: list[dict[str, Any]], sizes: list[int], p: int) -> str | None:
    """More bytes than a reduce-scatter and an all-gather per layer:
    say which collectives did it."""
    want = [8 * sum(collective_sent(kind, "ring", p, r, n) for n in sizes
                    for kind in ("reduce_scatter", "allgather")) for r in range(p)]
    for t in range(STEPS):
        sent = [rank["sent"][t] for rank in run]
        if sum(sent) <= _BYTES_SLACK * sum(want):
            continue
        called = Counter()
        for rank in run:
            called.update(rank["called"][t])
        said = ", ".join(f"{k} {v // p}x" for k, v in sorted(called.items()))
        why = (
            (
                "an all-reduce leaves the whole sum on every rank, but a rank needs only its own "
                "chunk: reduce_scatter sends half of an all-reduce's bytes"
            )
            if called.get("allreduce")
            else "ZeRO-2 needs one reduce-scatter and one all-gather of each layer, nothing more"
        )
        return (f"in step {t} the ranks sent {sum(sent) / sum(want):.2f}x the bytes of ZeRO-2 "
                f"({sum(sent):,} against {sum(want):,}; each rank called {said}): {why}")
    return None


def _too_much_memory(run: list[dict[str, Any]], sizes: list[int], p: int) -> str | None:
    """A peak above two layers in flight: the buffers were kept (or a view kept them alive)."""
    allow, whole = in_flight_bytes(sizes), 8 * sum(sizes)
    for r, rank in enumerate(run):
        for t in range(STEPS):
            peak = rank["peak"][t]
            if peak <= allow:
                continue
            said = (f"in step {t} rank {r} held {_kib(peak)} KiB at its peak, {peak / whole:.0%} "
                    f"of the whole gradient ({_kib(whole)} KiB), where ZeRO-2 holds a few layers "
                    f"at a time (the check allows half the gradient, {_kib(allow)} KiB)")
            if rank["views"]:
                v = rank["views"][0]
                return (f"{said}: shard[{v}] is a view into layer {v}'s gradient buffer (g[a:b], "
                        "and what reduce_scatter returns, is a slice, and a slice keeps all of g "
                        "alive): copy your chunk into it, shard[layer][:] = g[a:b]")
            if rank["during"][t]:
                return (f"{said}. You reduce-scattered each layer as backward yielded it, as "
                        "ZeRO-2 does, but kept something that holds its buffer: "
                        "reduce_scatter(comm, g) returns a view of your chunk inside g, and a view "
                        "(or g itself) kept in a list or a dict holds all of g until the step "
                        "ends. Copy the chunk into shard[layer][:] and keep nothing of g")
            if rank["reduced_during"][t]:
                return (f"{said}: you reduced each layer as backward yielded it but kept its "
                        "whole buffer (g, kept in a list or a dict, holds the layer's whole sum "
                        "until the step ends), which is plain data parallelism's memory. "
                        "Reduce-scatter g, copy your chunk into shard[layer][:] and keep nothing "
                        "of g")
            return (f"{said}: every layer's gradient buffer stayed alive until after backward. "
                    "Reduce-scatter each layer as backward yields it, keep your chunk in "
                    "shard[layer] and drop the buffer (del g) before the next; collecting the "
                    "gradient and reducing it after backward is ZeRO-1's pattern")
    return None


def collect_zero2(file: Path, inputs: dict[str, Any], out: dict[str, Any], deadline: float) -> None:
    """In the child: for each p, every rank's parameters, bytes and peak memory after every step.

    The ranks stop themselves a little before ``deadline``, so that the traceback names the
    learner's line; a rank that does not stop is killed with the child, by the parent."""
    load_function(file, "zero2_step")  # a file that does not import fails here, not on every rank
    out["runs"] = runs = []
    for p in inputs["world_sizes"]:
        done = run_ranks(_rank, p, (str(file), _CFG, deadline), file, "zero2_step", TIMEOUT_S)
        runs.append([{"after": [base64.b64encode(a.tobytes()).decode() for a in rank["after"]],
                      "sent": rank["sent"], "called": rank["called"], "peak": rank["peak"],
                      "views": rank["views"], "during": rank["during"],
                      "reduced_during": rank["reduced_during"]} for rank in done])


def _rank(comm: Any, file: str, cfg: TrainConfig, deadline: float) -> dict[str, Any]:
    """One rank: the real backward of its samples, the learner's step, and what it sent and held."""
    stop_before(deadline)
    before = dplab_functions()
    zero2_step = load_function(Path(file), "zero2_step")
    model, data, init = setup(cfg)
    slices = [model.layer_slice(i) for i in range(model.num_layers)]
    flat = comm.empty(model.num_params, init.dtype)
    flat[:] = init
    params = [flat[s] for s in slices]
    sizes = [s.stop - s.start for s in slices]
    own = [chunk_bounds(n, comm.world_size)[comm.rank] for n in sizes]
    shards = [np.zeros(b - a, dtype=init.dtype) for a, b in own]
    optimizer = ShardOptimizer(cfg.optimizer, sizes, comm.rank, comm.world_size, init.dtype)
    after, sent, called, peak, views, during, reduced_during = [], [], [], [], [], [], []
    traffic = Traffic.install(comm)
    tampered = ""
    tracemalloc.start()
    for step in range(cfg.steps):
        batch = batch_indices(cfg.num_samples, cfg.global_batch, step, cfg.seed)
        idx = shard(batch, comm.rank, comm.world_size)
        x, y = data.x[idx].astype(init.dtype), data.y[idx]
        shard_list = list(shards)
        for s in shard_list:
            s[:] = 0
        backward = _Counted(backward_layers(model, params, x, y, 1 / cfg.global_batch))
        traffic.when = lambda backward=backward: backward.yielded
        traffic.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with same_process():
            zero2_step(comm, backward, params, shard_list, optimizer)
        peak.append(tracemalloc.get_traced_memory()[1] - base)
        traffic.stop()
        tampered = tampered or traffic.tampered(comm, "zero2_step")
        sent.append(traffic.sent)
        # a reduce-scatter called before backward had yielded every layer: ZeRO-2's interleaving
        during.append(any(k == "reduce_scatter" and n < len(sizes) for k, n in traffic.marks))
        reduced_during.append(any(n < len(sizes) for _, n in traffic.marks))  # any collective
        called.append(dict(traffic.called))
        views.extend(i for i, s in enumerate(shard_list)
                     if s is not shards[i] and isinstance(s, np.ndarray) and s.base is not None)
        del backward, shard_list
        after.append(np.array(flat, copy=True))
    tracemalloc.stop()
    signal.setitimer(signal.ITIMER_REAL, 0)
    return {
        "after": after,
        "sent": sent,
        "called": called,
        "peak": peak,
        "views": sorted(set(views)),
        "during": during,
        "reduced_during": reduced_during,
        "patched": patched_since(before, Path(file)),
        "tampered": tampered,
    }


class _Counted:
    """The backward generator, counting the layers it has yielded (read when a collective is
    called)."""

    def __init__(self, layers: Iterator[tuple[int, np.ndarray]]) -> None:
        self.layers, self.yielded = layers, 0

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for item in self.layers:
            self.yielded += 1
            yield item


def _diagnose(runs: list[list[np.ndarray]], oracle: list[np.ndarray], sizes: list[int], p: int,
              counts: list[dict[str, Any]]) -> str | None:
    """The first (step, layer, chunk, rank) that differs from one device, said as what went wrong
    (``counts``: each rank's collectives called per step, to tell a missing all-gather from a
    misplaced one)."""
    starts = np.cumsum([0, *sizes])
    scale = float(np.abs(oracle[-1]).max())

    def close(x: np.ndarray, y: np.ndarray) -> bool:
        return bool(np.abs(x - y).max(initial=0.0) <= _RTOL * scale)

    for t in range(STEPS):
        want, before = oracle[t + 1], oracle[t]
        chunks = [(layer, s, starts[layer] + a, starts[layer] + b) for layer, n in enumerate(sizes)
                  for s, (a, b) in enumerate(chunk_bounds(n, p)) if b > a]
        for layer, s, a, b in chunks:  # first the owners: did each update its own chunk right?
            got = runs[s][t][a:b]
            if not close(got, want[a:b]):
                return _wrong_update(t, layer, s, got, want[a:b], before[a:b], p)
        for r in range(p):  # then the copies: did every owner's update reach every rank?
            for layer, s, a, b in chunks:
                got = runs[r][t][a:b]
                if close(got, want[a:b]):
                    continue
                if close(got, before[a:b]):
                    said = (f"after step {t} rank {r} still holds rank {s}'s chunk of layer "
                            f"{layer} as it was before the step: rank {s} updated it, but")
                    if counts[r]["called"][t].get("allgather", 0):
                        return (f"{said} your all-gather carried the chunk as it was before the "
                                "update: all-gather each layer's weights themselves (not a copy) "
                                "after optimizer.step has updated every rank's chunk")
                    return f"{said} no all-gather brought the update to rank {r}"

                return (f"after step {t} rank {r}'s copy of rank {s}'s chunk of layer {layer} "
                        f"differs from its owner's by {np.abs(got - want[a:b]).max():.3g}: the "
                        "all-gather must copy each owner's chunk to every rank")
    return None


def _wrong_update(t: int, layer: int, s: int, got: np.ndarray, want: np.ndarray, before: np.ndarray,
                  p: int) -> str:
    where = f"after step {t} rank {s}'s own chunk of layer {layer}"
    moved, right = got - before, want - before
    if not np.abs(moved).any():
        return (f"{where} did not move: rank {s} owns it and must update it in place (give "
                "optimizer.step views of the layer's weights, w[a:b], not copies: it changes them "
                "itself)")
    ratio = float(moved @ right / (right @ right)) if right.any() else float("nan")
    if p > 1 and abs(ratio * p - 1) < 1e-6:
        return (f"{where} moved 1/{p} as far as on one device: the gradient was averaged over the "
                "ranks, but every rank's loss is already scaled by 1/global batch, so the chunks' "
                "gradients are summed")
    if p > 1 and abs(ratio / p - 1) < 1e-6:
        return (f"{where} moved {p} times as far as on one device: "
                "was the gradient summed more than once?")
    return (f"{where} is off by {np.abs(got - want).max():.3g} from one device: rank {s} must step "
            "its chunk with the layer's gradient summed over all ranks, which the reduce-scatter "
            f"of that layer leaves in chunk {s} on rank {s}")
