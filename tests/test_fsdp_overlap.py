"""FSDP's overlap: reshard_after_forward in the engine, and lesson 15's prefetching exercise.

    pytest -q tests/test_fsdp_overlap.py      # the exercise's wrong answers, each on the sim
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from dplab.backends import launch
from dplab.reference.errors import ConfigError
from dplab.reference.model import MLPConfig
from dplab.reference.train.single import TrainConfig, train_single
from dplab.reference.zero.config import ZeroConfig
from dplab.reference.zero.train import train_zero

CFG = TrainConfig(model=MLPConfig(in_dim=16, hidden=(32,) * 3, out_dim=4), global_batch=16, steps=2)


def _sent(comm, cfg, zero):
    comm.tracer.enabled = True
    result = train_zero(comm, cfg, zero)
    sent = sum(e.bytes for e in comm.tracer.take() if e.kind == "send")
    return result, sent


@pytest.mark.parametrize("accum", [1, 2])
def test_keeping_forwards_gathers_saves_one_gather_a_layer_and_holds_every_layer(accum):
    p = 4
    runs = {rs: launch(_sent, p, args=(CFG, ZeroConfig(stage=3, accum_steps=accum,
                                                       reshard_after_forward=rs)))
            for rs in (True, False)}
    single = train_single(CFG).params
    for rs, ranks in runs.items():
        for result, _ in ranks:
            assert np.allclose(result.params, single, rtol=1e-10, atol=0), rs
    params = len(single)
    saved = runs[True][0][1] - runs[False][0][1]
    # one all-gather of every layer a micro-batch, (p-1)/p of the float64 weights sent by each rank
    assert saved == CFG.steps * accum * (p - 1) * params * 8 // p
    kept, resharded = runs[False][0][0], runs[True][0][0]
    # kept: its shards and every layer whole at the turn from forward to backward
    assert kept.memory.params == 8 * (kept.shard_elems + params)
    assert resharded.memory.params < kept.memory.params


def _dropped_at_once(comm):
    import gc
    import weakref

    from dplab.reference.collectives import allgather
    w = np.ones(1024, np.float32)
    alive = weakref.ref(w)
    gc.disable()  # only plain references count: a cycle would keep w until the collector ran
    try:
        allgather(comm, w, "ring")
        del w
        return alive() is None
    finally:
        gc.enable()


def test_the_sim_keeps_no_buffer_alive_after_its_messages_are_through():
    # the sim's messages held views of the buffers in send <-> receive cycles: an FSDP unit "freed"
    # after its gather stayed alive until the cycle collector ran, and the exercise counted it held
    assert all(launch(_dropped_at_once, 4, backend="sim", cluster="dgx-h100"))


def test_reshard_after_forward_must_be_a_bool():
    with pytest.raises(ConfigError, match="reshard_after_forward must be True or False"):
        ZeroConfig(stage=3, reshard_after_forward="no").validate(2)


RIGHT_DICT = """
def forward_units(n_units, gather, compute):
    pending = {0: gather(0)}
    for u in range(n_units):
        w, h = pending.pop(u)
        h.wait()
        if u + 1 < n_units:
            pending[u + 1] = gather(u + 1)
        compute(u, w)
"""

WRONG = {
    "prefetch issued after the compute": ("""
def forward_units(n_units, gather, compute):
    w, h = gather(0)
    for u in range(n_units):
        h.wait()
        compute(u, w)
        if u + 1 < n_units:
            w, h = gather(u + 1)
""", ("unit 1's gather was started only after unit 0 had run", "nothing overlapped")),
    "waiting on the wrong handle": ("""
def forward_units(n_units, gather, compute):
    w, h = gather(0)
    for u in range(n_units):
        nxt = gather(u + 1) if u + 1 < n_units else None
        (nxt[1] if nxt else h).wait()
        compute(u, w)
        if nxt:
            w, h = nxt
""", ("unit 0 ran before its own gather's handle was waited for",
      "the last wait was unit 1's")),
    "never resharding": ("""
kept = []
def forward_units(n_units, gather, compute):
    w, h = gather(0)
    for u in range(n_units):
        h.wait()
        nxt = gather(u + 1) if u + 1 < n_units else None
        compute(u, w)
        kept.append(w)
        if nxt:
            w, h = nxt
""", ("unit 0's gathered weights were still held", "never resharded")),
    "gathering every unit up front": ("""
def forward_units(n_units, gather, compute):
    pairs = [gather(u) for u in range(n_units)]
    for u, (w, h) in enumerate(pairs):
        h.wait()
        compute(u, w)
""", ("all 8 units' gathers were started before unit 0 ran", "the whole model")),
    "waiting for the prefetch at once": ("""
def forward_units(n_units, gather, compute):
    w, h = gather(0)
    h.wait()
    for u in range(n_units):
        nxt = gather(u + 1) if u + 1 < n_units else None
        if nxt:
            nxt[1].wait()
        compute(u, w)
        if nxt:
            w = nxt[0]
""", ("unit 1's gather was waited for before unit 0 ran",)),
}


def _file(tmp_path, body):
    file = tmp_path / "fsdp_prefetch.py"
    file.write_text(textwrap.dedent(body))
    return file


def test_the_solution_and_another_right_answer_pass_and_the_stub_fails(tmp_path):
    from dplab.lessons.exercises import EXERCISES, check_file

    exercise = EXERCISES["fsdp_prefetch"]
    for file in (exercise.solution, _file(tmp_path, RIGHT_DICT)):
        report = check_file("fsdp_prefetch", file)
        assert report.passed, report.message
        assert "100% of the gathers' time after the first" in report.message
        assert "86 us against 128 us" in report.message
    stub = check_file("fsdp_prefetch", exercise.stub_path)
    assert not stub.passed and "started only after unit 0 had run" in stub.message


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_prefetch_fails_naming_its_mistake(tmp_path, name):
    from dplab.lessons.exercises import check_file

    body, says = WRONG[name]
    report = check_file("fsdp_prefetch", _file(tmp_path, body))
    assert not report.passed, name
    for phrase in says:
        assert phrase in report.message, (name, report.message)
