"""The parameter server in pieces, each tested alone; and its two lags, each in its own unit.

``reference/ps/server.py`` is the loop; the SSP gate (gate.py), per-clock aggregation with
backup workers (aggregate.py), lost-worker bookkeeping (lost.py) and checkpoints
(snapshot.py) are small classes that work without a server, a world or a clock.

Staleness counts CLOCKS (how far a worker may run ahead of the slowest: the gate's
bound); a log entry's delay counts UPDATES (how many landed between its pull and its
own update). Lock-step (staleness 0) still has delays of up to W - 1.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from dplab.backends.cli.commands import main
from dplab.backends.launch.world import launch
from dplab.reference.communicator import CommTimeout
from dplab.reference.ps import server
from dplab.reference.ps.aggregate import Aggregator
from dplab.reference.ps.gate import Gate
from dplab.reference.ps.lost import Roster
from dplab.reference.ps.protocol import LogEntry
from dplab.reference.ps.trainer import AsyncConfig, train_async
from dplab.reference.trace import Tracer
from dplab.reference.train.single import TrainConfig


def test_gate_holds_a_pull_until_the_slowest_live_worker_is_within_staleness_clocks() -> None:
    gate = Gate(workers=3, staleness=1)
    assert gate.opens(1) and not gate.opens(2)  # nobody has finished a clock yet
    gate.finish(1, 0)
    gate.finish(2, 0)
    assert not gate.opens(2) and gate.slowest(default=0) == 0  # worker 3 holds everyone back
    assert gate.forget(3) == 0  # it died, having finished no clock
    assert gate.opens(2) and not gate.opens(3) and gate.slowest(default=0) == 1
    assert gate.next_clock(1, 0) == 1  # a resumed worker asking for clock 0 gets its next one
    assert Gate(2, None).opens(10**6)  # unbounded: never holds
    lockstep = Gate(2, 0)
    lockstep.finish(1, 0)
    assert not lockstep.opens(1)


def test_aggregator_hands_over_the_first_w_minus_b_gradients_in_worker_order() -> None:
    agg = Aggregator(workers=3, backup_workers=1)
    g = {w: np.full(2, float(w)) for w in (1, 2, 3)}
    assert agg.hold(3, 0, g[3]) is None
    g[3][:] = -1  # the server reuses its receive buffer: the aggregator must have copied it
    ready = agg.hold(2, 0, g[2])
    assert [w for w, _ in ready] == [2, 3] and ready[1][1].tolist() == [3.0, 3.0]
    assert agg.late(0, version=1) and not agg.late(1, version=1)
    agg.drop(1, 0)
    assert agg.dropped == [(1, 0)] and agg.held == {}
    every = Aggregator(workers=2)
    assert every.hold(1, 0, g[1]) is None and len(every.hold(2, 0, g[2])) == 2


class _Silent:
    """A communicator stub: calls time out until ``answer_after`` tries; ``dead`` ranks are dead."""

    timeout = 5.0

    def __init__(self, dead: set[int], answer_after: int) -> None:
        self.dead, self.tries, self.answer_after = dead, 0, answer_after
        self.tracer = Tracer(0)

    def patience(self, seconds: float):
        from contextlib import nullcontext
        return nullcontext()

    def peer_alive(self, rank: int) -> bool:
        return rank not in self.dead

    def call(self) -> str:
        self.tries += 1
        if self.tries <= self.answer_after:
            raise CommTimeout("silence")
        return "message"


def test_roster_tells_dead_from_slow_and_hands_each_death_over_once() -> None:
    comm = _Silent(dead={2}, answer_after=3)
    roster = Roster(comm, workers=3, clocks=5)
    assert roster.listen(comm.call, peer=1) == "message"  # worker 1 was slow, not dead
    assert roster.take_dead() == [2] and roster.take_dead() == []
    roster.lose(2, clocks_done=4)
    assert roster.active == {1, 3} and roster.lost == {2: 4}
    comm.tries = 0
    assert roster.listen(comm.call) == "message"  # 2 is known lost: not reported again
    comm.dead.add(3)
    comm.tries = 0
    # ANY_SOURCE: a death ends it
    assert roster.listen(comm.call) is None and roster.take_dead() == [3]
    roster.leave(1)
    assert roster.active == {3} and not Roster(comm, 3, clocks=0).active


def test_server_py_is_the_loop_and_each_rule_lives_in_its_own_piece() -> None:
    source = Path(server.__file__).read_text()
    docstrings = sum(n.body[0].end_lineno - n.body[0].lineno + 1
                     for n in ast.walk(ast.parse(source))
                     if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
                     and ast.get_docstring(n) is not None)
    assert len(source.splitlines()) - docstrings <= 230  # the code; its contracts are extra
    for piece in ("Gate(", "Aggregator(", "Roster(", "Snapshots("):
        assert piece in source
    for inlined in ("peer_alive", "save_state", "load_resume", "min(done"):
        assert inlined not in source, f"{inlined} belongs in a piece, not the loop"


# -- two lags, two units ---------------------------------------------------------------------

def test_delay_counts_updates_while_staleness_counts_clocks() -> None:
    """Lock-step (staleness 0 clocks), every worker sleeping 50 ms before it computes: from clock 1
    on, a clock's three pulls are answered at one version, so its third push lands 2 updates
    late."""
    cfg, acfg = TrainConfig(steps=3), AsyncConfig(staleness=0, delays=(0.05, 0.05, 0.05))
    log = launch(train_async, 4, args=(cfg, acfg))[0].log
    assert not hasattr(LogEntry, "staleness")  # one word, one unit
    assert all(e.clock - e.slowest_done == 0 for e in log)  # clocks ahead: 0, as configured
    assert all(e.delay == e.produced - 1 - e.version for e in log)
    assert max(e.delay for e in log if e.clock >= 1) == 2  # updates: W - 1 others landed first


def test_cli_row_reports_max_delay_in_updates(tmp_path: Path) -> None:
    out = tmp_path / "row.json"
    assert (
        main(
            [
                "train",
                "--mode",
                "async",
                "--world-size",
                "3",
                "--staleness",
                "0",
                "--steps",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert "max_staleness" not in row and 0 <= row["max_delay"] <= 1  # W - 1 = 1 with lock-step


@pytest.mark.parametrize("aggregate", [False, True])
def test_apply_trace_events_carry_the_delay(aggregate: bool) -> None:
    def traced(comm, cfg, acfg):
        comm.tracer.enabled = True
        return train_async(comm, cfg, acfg)

    cfg, acfg = TrainConfig(steps=3), AsyncConfig(staleness=0, aggregate=aggregate)
    server_result = launch(traced, 3, args=(cfg, acfg))[0]
    applies = [e for e in server_result.events if e.kind == "apply"]
    assert [e.extra["delay"] for e in applies] == [e.delay for e in server_result.log]
