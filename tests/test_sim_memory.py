"""A model that does not fit the simulated device is refused in one line, exit 2, before any rank
starts, saying by how much; a ZeRO run is judged on its shard, with its activations and the
layer it gathers counted (``RunSpec.check_cluster``)."""

from __future__ import annotations

import json

import pytest

from dplab.backends.runs import RunSpec
from dplab.reference.model import MLPConfig
from dplab.reference.optim import OptimConfig
from dplab.reference.train.single import TrainConfig

# Six hidden layers of 500: 1.25 M float64 parameters; Adam holds 8 + 8 + 16 bytes of each
# (40 MB a replica), ZeRO-3 on 4 ranks a quarter of that plus one gathered layer and its gradient
HIDDEN = "500,500,500,500,500,500"


def _cluster(tmp_path, memory_gb: float) -> str:
    doc = {"name": "small", "nodes": 1, "ranks_per_node": 4,
           "device": {"tflop_s": 10, "memory_gb": memory_gb, "memory_gb_s": 500},
           "links": {"intra": {"alpha_us": 2, "bandwidth_gb_s": 100}}}
    path = tmp_path / f"small-{memory_gb}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _train(cli_here, cluster: str, *more: str):
    return cli_here("train", "--backend", "sim", "--cluster", cluster, "--world-size", "4",
                    "--hidden", HIDDEN, "--optimizer", "adam", *more)


def _one_line(done, *words: str) -> None:
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert all(w in done.stderr for w in words), done.stderr


def test_a_replica_that_does_not_fit_is_refused_by_how_much(cli_here, tmp_path):
    done = _train(cli_here, _cluster(tmp_path, 0.025))
    _one_line(done, "each rank's model replica needs", "GB too many",
              "activations", "--zero-stage")
    need = float(done.stderr.split("needs ")[1].split(" GB")[0])
    short = float(done.stderr.split(": ")[-2].split(" GB too many")[0])
    assert need > 0.04 and short == pytest.approx(need - 0.025, abs=1e-3)


def test_a_shard_that_does_not_fit_is_refused(cli_here, tmp_path):
    done = _train(cli_here, _cluster(tmp_path, 0.01), "--zero-stage", "3")
    _one_line(done, "ZeRO-3 shard needs", "GB too many")


def test_a_shard_fits_where_its_replica_does_not(tmp_path):
    cluster = _cluster(tmp_path, 0.025)
    cfg = TrainConfig(model=MLPConfig(hidden=(500,) * 6), optimizer=OptimConfig("adam"))
    RunSpec(backend="sim", world_size=4, train=cfg, zero_stage=3, cluster=cluster).validate()
    with pytest.raises(Exception, match="ZeRO-1 shard needs"):  # stage 1 keeps whole gradients
        RunSpec(backend="sim", world_size=4, train=cfg, zero_stage=1, cluster=cluster).validate()


def test_activations_count(tmp_path):
    """A batch whose activations alone overflow the device is refused though the model is tiny."""
    cfg = TrainConfig(model=MLPConfig(hidden=(4096,) * 2), global_batch=100_000,
                      num_samples=100_000)
    with pytest.raises(Exception, match="activations and gathered layers"):
        RunSpec(backend="sim", world_size=4, train=cfg, cluster=_cluster(tmp_path, 1.0)).validate()
