"""The large-batch sweep of ``dplab compare``: what a bigger global batch buys, per step and per
sample.

    dplab compare --global-batches 64,256,1024,4096 --lr-rule linear,sqrt --optimizer momentum --lr
    0.05 dplab compare --global-batches 64,4096 --lr-rule sqrt --warmup-steps 5 --json sweep.json

Each cell is a real synchronous data-parallel run (``--backends`` x ``--world-sizes`` x
``--algorithms``) at one global batch B, with the lr of one rule (``dplab.reference.lr.scaled_lr``:
``--lr`` is right at ``--base-batch``). Every cell sees S = ``--steps`` x the largest batch samples
(ceil(S / B) steps), and the row reports the full data set's loss

    loss@<k>steps     after k steps                      (bigger batches win here ...)
    loss@<s>samples   after the first step with >= s samples seen   (... and lose here, beyond
                                                          the "critical batch")

Intermediate losses come from the single-device oracle (``train_single``) stopped at that step;
``max_abs_diff_vs_single`` shows the data-parallel run is that run to rounding, and ``final_loss``
is its own. An lr too large for its batch trains unstably and amplifies rounding: a large diff in
a sweep row means "unstable", not "wrong". Data, unless given: ``args_optim.SWEEP_DATA`` (8192
samples).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dplab.backends.cli.args import AUTO
from dplab.backends.cli.args_optim import SWEEP_DATA, is_default
from dplab.backends.cli.compare import run_specs
from dplab.backends.cli.table import Progress
from dplab.backends.runs.run import RunSpec
from dplab.reference.errors import ConfigError
from dplab.reference.lr import scaled_lr
from dplab.reference.train.single import TrainConfig, evaluate, train_single

__all__ = ["Sweep", "sweep_specs", "run_sweep", "cmd_sweep", "wants_sweep", "sweep_columns",
           "SWEEP_DEFAULTS"]

SWEEP_DEFAULTS = {"rules": ["linear"], "base_batch": 64, "world_sizes": [2], "algorithms": ["ring"]}
SWEEP_OPTIONS = {"--global-batches": "global_batches", "--lr-rule": "lr_rule",
                 "--base-batch": "base_batch",
                 "--at-steps": "at_steps", "--at-samples": "at_samples"}


@dataclass(frozen=True)
class Sweep:
    """The grid's large-batch axes and where the losses are read (see the module docstring)."""

    global_batches: tuple[int, ...]
    rules: tuple[str, ...] = ("linear",)
    base_batch: int = 64
    at_steps: tuple[int, ...] | None = None  # default: steps // 5 and steps
    at_samples: tuple[int, ...] | None = None  # default: the largest batch x each of at_steps

    def marks(self, steps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(at_steps, at_samples) for ``--steps`` = ``steps``, checked to lie inside every cell."""
        if (steps < 1 or not self.global_batches or min(self.global_batches) < 1
                or self.base_batch < 1):
            raise ConfigError("a sweep needs --steps >= 1, global batches >= 1 and "
                              f"--base-batch >= 1, got {steps}, {list(self.global_batches)}, "
                              f"{self.base_batch}")
        biggest = max(self.global_batches)
        at_steps = tuple(sorted(set(self.at_steps or (max(1, steps // 5), steps))))
        at_samples = tuple(sorted(set(self.at_samples or (biggest * k for k in at_steps))))
        if max(at_steps) > steps:
            raise ConfigError(f"--at-steps {max(at_steps)} is past --steps {steps}, which "
                              "the largest batch takes: give marks up to --steps, or more --steps")
        if max(at_samples) > steps * biggest:
            raise ConfigError(f"--at-samples {max(at_samples)} is past the {steps * biggest} "
                              f"samples every cell sees (--steps x {biggest}): give fewer, or "
                              "more --steps")
        return at_steps, at_samples


def sweep_specs(base: RunSpec, sweep: Sweep, backends: Sequence[str], world_sizes: Sequence[int],
                algorithms: Sequence[str]) -> list[tuple[str, RunSpec]]:
    """(rule, cell): one synchronous cell per backend x world size x algorithm x global batch x
    rule, grouped by (backend, world size) as ``run_specs`` wants; ``base.train.steps`` is the
    largest batch's number of steps."""
    samples = base.train.steps * max(sweep.global_batches)
    opt = base.train.optimizer
    specs = []
    for b in backends:
        for p in world_sizes:
            for alg in algorithms:
                for batch in sweep.global_batches:
                    for rule in sweep.rules:
                        lr = scaled_lr(opt.lr, sweep.base_batch, batch, rule)
                        train = replace(base.train, global_batch=batch,
                                        steps=math.ceil(samples / batch),
                                        optimizer=replace(opt, lr=lr))
                        specs.append((rule, replace(base, backend=b, world_size=p, algorithm=alg,
                                                    mode="sync", train=train)))
    return specs


def run_sweep(base: RunSpec, sweep: Sweep, backends: Sequence[str], world_sizes: Sequence[int],
              algorithms: Sequence[str]) -> list[dict[str, Any]]:
    """Run every cell (``compare.run_specs``), then read each one's losses at the marks."""
    at_steps, at_samples = sweep.marks(base.train.steps)
    cells = sweep_specs(base, sweep, backends, world_sizes, algorithms)
    rows = run_specs([spec for _, spec in cells])
    cache: dict[TrainConfig, float] = {}  # the oracle's loss after k steps, shared by equal cells
    progress = Progress(len(rows))
    for (rule, spec), row in zip(cells, rows):
        cfg = spec.train
        row.update(dataset=cfg.dataset, lr_rule=rule, base_batch=sweep.base_batch,
                   lr=cfg.optimizer.lr,
                   optimizer=cfg.optimizer.name, warmup_steps=cfg.optimizer.warmup_steps)
        for k in at_steps:
            row[f"loss@{k}steps"] = _loss_after(cfg, k, row, cache)
        for s in at_samples:
            row[f"loss@{s}samples"] = _loss_after(cfg, math.ceil(s / cfg.global_batch), row, cache)
        progress.step(f"losses of batch {cfg.global_batch} {rule}")
    progress.close()
    return rows


def _loss_after(cfg: TrainConfig, k: int, row: dict[str, Any],
                cache: dict[TrainConfig, float]) -> float:
    """The full data set's loss after ``k`` steps of ``cfg``."""
    if k == cfg.steps:
        return row["final_loss"]  # the data-parallel run's own
    key = replace(cfg, steps=k)
    if key not in cache:
        cache[key] = float(evaluate(key, train_single(key).params))
    return cache[key]


def sweep_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table's columns: the cell, its lr, its budget, the losses at the marks."""
    marks = [k for k in rows[0] if k.startswith("loss@")] if rows else []
    where = [c for c in ("backend", "world_size", "algorithm") if len({r[c] for r in rows}) > 1]
    return [*where, "global_batch", "lr_rule", "lr", "steps", "samples", *marks,
            "max_abs_diff_vs_single", "wall_s"]


def wants_sweep(a: argparse.Namespace) -> bool:
    """Whether ``dplab compare`` was given any of the sweep's options."""
    return any(getattr(a, k) is not None for k in SWEEP_OPTIONS.values())


def cmd_sweep(a: argparse.Namespace, train_config: Callable[[argparse.Namespace, None], TrainConfig]
              ) -> list[dict[str, Any]]:
    """``dplab compare --global-batches ...``: the parsed options to rows (``train_config`` is
    the command line's own TrainConfig builder, so every model and optimizer option applies)."""
    if a.global_batches is None:
        given = [o for o, k in SWEEP_OPTIONS.items() if getattr(a, k) is not None]
        raise ConfigError(f"{', '.join(given)}: only for the large-batch sweep; add "
                          "--global-batches (e.g. 64,256,1024,4096) or drop "
                          f"{'it' if len(given) == 1 else 'them'}")
    if any(m != "sync" for m in a.modes):
        raise ConfigError(f"the large-batch sweep trains synchronously (all-reduce): drop --modes "
                          f"{','.join(a.modes)} or --global-batches")
    if a.time_budget not in (None, AUTO) or a.straggler:
        raise ConfigError("the large-batch sweep compares losses at equal steps and samples: drop "
                          "--time-budget and --straggler, or --global-batches")
    for key, value in SWEEP_DATA.items():
        if is_default(getattr(a, key)):
            setattr(a, key, value)
    base = RunSpec(train=train_config(a, None), bucket_cap_mb=a.bucket_cap_mb,
                   accum_steps=a.accum_steps)
    sweep = Sweep(tuple(a.global_batches), tuple(a.lr_rule or SWEEP_DEFAULTS["rules"]),
                  a.base_batch or SWEEP_DEFAULTS["base_batch"], _tuple(a.at_steps),
                  _tuple(a.at_samples))
    return run_sweep(base, sweep, a.backends, a.world_sizes or SWEEP_DEFAULTS["world_sizes"],
                     a.algorithms or SWEEP_DEFAULTS["algorithms"])


def _tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return tuple(values) if values else None
