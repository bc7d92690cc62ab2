"""ZeRO's memory, measured: the ledger's per-rank peaks against the closed forms, and the ledger
against tracemalloc.

Per rank, in float64 (8 bytes per parameter, gradient and optimizer-state element; k state
arrays: 0 sgd, 1 momentum, 2 adam), with Psi parameters, m_r the elements rank r owns (one
chunk of every layer; sum over ranks: Psi) and n_l the size of layer l, the trainer holds at
its peak during a step, exactly:

    stage 0   params 8 Psi            grads 8 Psi                 optimizer 8k Psi
    stage 1   params 8 Psi            grads 8 Psi                 optimizer 8k m_r
    stage 2   params 8 Psi            grads 8 m_r + 8 G           optimizer 8k m_r
    stage 3   params 8 m_r + 8 P      grads 8 m_r + 8 G           optimizer 8k m_r

    G = max over adjacent layers of n_l + n_(l+1) (n_0 for one layer): the layer buffer being
        reduce-scattered while the next one's gradient is computed;
    P = with prefetch, max over consecutive uses (forward 0..L-1, backward L-1..0, per
        micro-batch) of the two layers' sizes: the layer computing and the one being gathered;
        without prefetch, max n_l.

So the sharded terms' mean over the ranks is exactly the closed form of
``dplab.reference.zero.memory.model_state_bytes`` (Psi / N), and G, P are the in-flight allowance.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig
from dplab.reference.zero import ledger as ledger_module
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.ledger import MemoryLedger
from dplab.reference.zero.memory import model_state_bytes
from dplab.reference.zero.train import train_zero

STATES = {"sgd": 0, "momentum": 1, "adam": 2}


def _memory(comm, cfg, zero):
    r = train_zero(comm, cfg, zero)
    return r.memory, r.shard_elems


def layer_sizes(cfg: TrainConfig) -> list[int]:
    model = MLP(cfg.model)
    slices = [model.layer_slice(layer) for layer in range(model.num_layers)]
    return [s.stop - s.start for s in slices]


def grads_in_flight(sizes: list[int]) -> int:
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])


def params_in_flight(sizes: list[int], accum_steps: int, prefetch: bool) -> int:
    if not prefetch:
        return max(sizes)
    uses = [*range(len(sizes)), *reversed(range(len(sizes)))] * accum_steps
    return max(sizes[a] + sizes[b] for a, b in zip(uses, uses[1:]))


def expected(stage: int, psi: int, m: int, k: int, sizes: list[int], zero: ZeroConfig) -> tuple:
    """(params, grads, optimizer) peak bytes of one rank owning m elements, by the table above."""
    g_extra = grads_in_flight(sizes) if stage >= 2 else 0
    p_extra = params_in_flight(sizes, zero.accum_steps, zero.prefetch) if stage == 3 else 0
    return (8 * ((m if stage == 3 else psi) + p_extra), 8 * ((m if stage >= 2 else psi) + g_extra),
            8 * k * (m if stage >= 1 else psi))


MODELS = [MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3),    # layers 42, 48, 21: uneven chunks
          MLPConfig(in_dim=9, hidden=(), out_dim=4)]        # one layer of 40


@pytest.mark.parametrize("model", MODELS, ids=["3-layers", "1-layer"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("stage, accum_steps, prefetch", [
    (0, 1, True), (1, 1, True), (2, 2, True), (3, 1, True), (3, 2, True), (3, 2, False)])
def test_measured_peaks_are_the_closed_forms_plus_the_stated_allowance(
    worlds, model, optimizer, p, stage, accum_steps, prefetch
):
    cfg = TrainConfig(model=model, num_samples=40, global_batch=9, steps=2,
                      optimizer=OptimConfig(optimizer, lr=0.01))
    zero = ZeroConfig(stage=stage, accum_steps=accum_steps, prefetch=prefetch)
    sizes, k = layer_sizes(cfg), STATES[optimizer]
    psi = sum(sizes)
    results = worlds(p).run(_memory, cfg, zero)
    assert sum(m for _, m in results) == psi
    for rank, (mem, m) in enumerate(results):
        peaks = (mem.params, mem.grads, mem.optimizer)
        assert peaks == expected(stage, psi, m, k, sizes, zero), f"rank {rank}"
        assert max(peaks) <= mem.total <= sum(peaks)
    # Without the in-flight allowance, the mean over ranks IS the closed form (Psi / N and all).
    form = model_state_bytes(psi, stage, p, param_bytes=8, grad_bytes=8, state_bytes=8 * k)
    g_extra = 8 * grads_in_flight(sizes) if stage >= 2 else 0
    p_extra = 8 * params_in_flight(sizes, accum_steps, prefetch) if stage == 3 else 0
    assert sum(mem.params - p_extra for mem, _ in results) == pytest.approx(
        p * form.params, rel=1e-12
    )
    assert sum(mem.grads - g_extra for mem, _ in results) == pytest.approx(
        p * form.grads, rel=1e-12
    )
    assert sum(mem.optimizer for mem, _ in results) == pytest.approx(p * form.optimizer, rel=1e-12)


def test_stage3_holds_less_than_stage0_once_the_world_is_large_enough(worlds):
    """The point of it all, on a model whose layers are small next to the whole: adam, p = 4."""
    cfg = TrainConfig(model=MLPConfig(in_dim=6, hidden=(12, 12, 12, 12), out_dim=3), num_samples=40,
                      global_batch=8, steps=1, optimizer=OptimConfig("adam", lr=0.01))
    totals = [
        max(r.total for r, _ in worlds(4).run(_memory, cfg, ZeroConfig(stage=s))) for s in range(4)
    ]
    assert totals[0] > totals[1] > totals[2] > totals[3], totals


# -- the ledger is not a fiction: tracemalloc agrees at every allocation --------------------------

def _traced_against_ledger(comm, cfg, zero):
    """Train with tracemalloc on; at each allocation the ledger sees, the bytes that tracemalloc
    says are alive and were allocated under ledger.py (its ``zeros``/``empty``/``track``) must be
    the ledger's current total. Returns (checks, mismatches)."""
    checks, mismatches = [0], []
    domain, here = np.lib.tracemalloc_domain, ledger_module.__file__

    def compare(ledger: MemoryLedger) -> None:
        snap = tracemalloc.take_snapshot()
        snap = snap.filter_traces([tracemalloc.DomainFilter(True, domain)])
        snap = snap.filter_traces([tracemalloc.Filter(True, here, all_frames=True)])
        traced, told = sum(t.size for t in snap.traces), sum(ledger.current.values())
        checks[0] += 1
        if traced != told:
            mismatches.append((checks[0], traced, dict(ledger.current)))

    ledger = MemoryLedger()
    ledger.on_alloc = compare
    tracemalloc.start(40)
    try:
        train_zero(comm, cfg, zero, ledger=ledger)
    finally:
        tracemalloc.stop()
    return checks[0], mismatches


@pytest.mark.parametrize("stage, accum_steps, prefetch", [(0, 1, True), (1, 2, True), (2, 2, True),
                                                          (3, 2, True), (3, 1, False)])
def test_ledger_matches_tracemalloc_at_every_allocation(worlds, stage, accum_steps, prefetch):
    # Every layer has >= p elements, so no chunk is empty (numpy allocates 1 byte for an empty
    # array).
    cfg = TrainConfig(model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3), num_samples=40,
                      global_batch=9, steps=1, optimizer=OptimConfig("adam", lr=0.01))
    zero = ZeroConfig(stage=stage, accum_steps=accum_steps, prefetch=prefetch)
    for rank, (checks, mismatches) in enumerate(worlds(2).run(_traced_against_ledger, cfg, zero)):
        assert checks >= 3, "the hook never ran"
        assert mismatches == [], f"rank {rank}: (check, tracemalloc bytes, ledger) {mismatches[:3]}"
