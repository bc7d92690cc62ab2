"""ZeRO's communication, measured: bytes each rank sends per step, counted from the trace.

Per step and rank the trainer's collectives are, layer by layer (n_l elements, a micro-batches):
stage 0 one all-reduce; stage 1 a reduce-scatter and an all-gather; stage 2 a reduce-scatter per
micro-batch and an all-gather; stage 3 per micro-batch two all-gathers (forward, backward) and a
reduce-scatter. Each rank's count must be exactly what those schedules send (uneven chunks make
ranks differ), and their mean exactly the closed form: 2 (p-1)/p Psi for stages 0-1 (and 2 with
one micro-batch), 3 (p-1)/p Psi for stage 3.
"""

from __future__ import annotations

import pytest

from dplab.backends.launch.world import BackendUnavailable, check_backend
from dplab.reference.model import MLP, MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.traffic import collective_sent, sent_closed_form, sent_per_step
from dplab.reference.zero.train import train_zero

CFG = TrainConfig(
    model=MLPConfig(in_dim=5, hidden=(7, 6), out_dim=3),
    num_samples=40,
    global_batch=9,
    steps=2,
    optimizer=OptimConfig("momentum", lr=0.01),
)


def _sent(comm, cfg, zero):
    comm.tracer.take()
    comm.tracer.enabled = True
    try:
        train_zero(comm, cfg, zero)
    finally:
        comm.tracer.enabled = False
    return sent_per_step(comm.tracer.take(), comm.rank)


def schedules_say(stage: int, algorithm: str, p: int, rank: int, sizes: list[int], a: int) -> int:
    """Elements ``rank`` sends per step: the trainer's collectives, priced by their schedules."""
    def sent(kind: str, n: int) -> int:
        return collective_sent(kind, algorithm, p, rank, n)
    per_layer = {0: lambda n: sent("allreduce", n),
                 1: lambda n: sent("reduce_scatter", n) + sent("allgather", n),
                 2: lambda n: a * sent("reduce_scatter", n) + sent("allgather", n),
                 3: lambda n: a * (2 * sent("allgather", n) + sent("reduce_scatter", n))}[stage]
    return sum(per_layer(n) for n in sizes)


def _check_traffic(
    worlds, backend: str, stage: int, accum_steps: int, algorithm: str, p: int
) -> None:
    model = MLP(CFG.model)
    sizes = [(s := model.layer_slice(layer)).stop - s.start for layer in range(model.num_layers)]
    zero = ZeroConfig(stage=stage, algorithm=algorithm, accum_steps=accum_steps)
    per_rank = worlds(p, backend).run(_sent, CFG, zero)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == CFG.steps
        want = 8 * schedules_say(stage, algorithm, p, rank, sizes, accum_steps)
        assert steps == [want] * CFG.steps, (
            f"rank {rank}: sent {steps}, the schedules say {want} per step"
        )
    mean = sum(steps[0] for steps in per_rank) / p
    assert mean == pytest.approx(
        8 * sent_closed_form(stage, model.num_params, p, accum_steps), rel=1e-12
    )


@pytest.mark.parametrize(
    "stage, accum_steps", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 3), (2, 3), (3, 2)]
)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_bytes_sent_per_step_are_the_schedules_and_their_mean_the_closed_form(
    worlds, stage, accum_steps, algorithm, p
):
    _check_traffic(worlds, "local", stage, accum_steps, algorithm, p)


@pytest.mark.parametrize("engine", [pytest.param("mpi", marks=pytest.mark.mpi),
                                    pytest.param("torch", marks=pytest.mark.torch)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_the_engines_send_what_the_schedules_say(worlds, engine, stage, algorithm, p):
    """The same count on MPI and torch, for one micro-batch (the grid above runs on shared
    memory)."""
    try:
        check_backend(engine)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    _check_traffic(worlds, engine, stage, 1, algorithm, p)


def test_closed_forms_are_the_papers_2_and_3_psi():
    psi, p = 1000, 4
    assert (
        sent_closed_form(0, psi, p)
        == sent_closed_form(1, psi, p)
        == sent_closed_form(2, psi, p)
        == 1500
    )
    assert sent_closed_form(3, psi, p) == 2250  # 1.5x: the weights' second gather
    assert sent_closed_form(2, psi, p, accum_steps=3) == 3000  # a reduce-scatter per micro-batch
    assert sent_closed_form(1, psi, p, accum_steps=3) == 1500  # accumulates in its full gradient
