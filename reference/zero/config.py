"""The ZeRO trainer's configuration: which stage, which reduce-scatter/all-gather, micro-batches.

    ZeroConfig(stage=3, algorithm="ring", accum_steps=2, prefetch=True)   # validated by train_zero

Stage s shards the first s of (optimizer state, gradients, parameters) across the ranks; stage 0
is plain data parallelism (replicas and an all-reduce), kept as the baseline the others are
measured against. Stages 1-3 are built from a reduce-scatter and an all-gather, so they need an
algorithm that has those two schedules (ring, direct); stage 0 takes any all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from dplab.reference.algorithms import ALGORITHMS, SCATTER_ALGORITHMS, has_schedule
from dplab.reference.errors import ConfigError
from dplab.reference.precision.config import MixedPrecision

__all__ = ["ZeroConfig", "SCATTER_ALGORITHMS"]



@dataclass(frozen=True)
class ZeroConfig:
    """``stage`` 0-3; ``algorithm`` of the collectives; ``accum_steps`` micro-batches per step;
    ``prefetch`` (stage 3): gather the next layer on the comm thread while this one computes;
    ``reshard_after_forward`` (stage 3): free a layer's gathered weights after its forward (True,
    torch's FULL_SHARD) or keep them for its backward (False: one gather a layer, more memory);
    ``precision``: float16 compute copies of float32 masters, loss scaling
    (``reference/precision``).

    Args:
        stage: 0, 1, 2 or 3.
        algorithm: the collectives' algorithm.
        accum_steps: micro-batches per step.
        prefetch: stage 3: gather the next layer while this one computes.
        precision: mixed precision, or None.
        reshard_after_forward: stage 3: free a layer's weights after its forward.
    """

    stage: int = 1
    algorithm: str = "ring"
    accum_steps: int = 1
    prefetch: bool = True
    precision: MixedPrecision | None = None
    reshard_after_forward: bool = True

    def validate(self, world_size: int | None = None) -> None:
        """Raise ``ConfigError`` naming the field and the fix.

        Args:
            world_size: the number of ranks, if known.

        Raises:
            ConfigError: a bad stage, algorithm, accum_steps, prefetch, precision or world_size.
        """
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.stage == 0:
            if not has_schedule(self.algorithm):
                raise ConfigError(f"unknown algorithm {self.algorithm!r}: stage 0 all-reduces, "
                                  f"choose one of {', '.join(ALGORITHMS)}")
        elif not has_schedule(self.algorithm, "scatter"):
            raise ConfigError(
                f"ZeRO stage {self.stage} reduce-scatters gradients and all-gathers parameters, "
                f"and {self.algorithm!r} has no such schedules: choose one of "
                f"{', '.join(SCATTER_ALGORITHMS)} (naive, tree and native have only an all-reduce; "
                "stage 0 takes them)")
        steps = self.accum_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"accum_steps must be an integer >= 1, got {self.accum_steps!r}")
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"prefetch must be True or False, got {self.prefetch!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError("reshard_after_forward must be True or False, got "
                              f"{self.reshard_after_forward!r}")
        if self.precision is not None:
            if not isinstance(self.precision, MixedPrecision):
                raise ConfigError("precision must be a MixedPrecision or None, got "
                                  f"{self.precision!r}")
            self.precision.validate()
        if world_size is not None and world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
