"""Schemas of the points recipe's `model` and `data` config groups (their RANGES tables are optional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from core.config.errors import require
from core.config.ranges import INT32_MAX, Int, Real, Rule
from core.config.schema import DataConfig, ModelConfig


@dataclass
class PointsModelConfig(ModelConfig):
    hidden_size: int = 32  # x -> hidden -> ReLU -> y

    RANGES: ClassVar[dict[str, Rule]] = {"hidden_size": Int(1, 65536)}


@dataclass
class PointsDataConfig(DataConfig):
    dims: int = 3  # each point's coordinates, the model's inputs
    train_points: int = 1024
    val_points: int = 128
    noise: float = 0.1  # std of the noise added to the inputs, drawn anew for every sample of every epoch
    seed: int = 0  # the points and the function's weights
    num_workers: int = 0  # the points are generated in memory: workers would only wait

    RANGES: ClassVar[dict[str, Rule]] = {
        "dims": Int(1, 65536),
        "train_points": Int(1, INT32_MAX),
        "val_points": Int(1, INT32_MAX),
        "noise": Real(0, 100),
        "seed": Int(0, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        """The points are generated at once, in memory, before the first step: a count and a size valid each on its
        own can ask for more numbers than any machine holds (the allocation then fails with a traceback). An int32
        count of them is far beyond what a small example needs."""
        numbers = (c.train_points + c.val_points) * c.dims
        require(
            numbers <= INT32_MAX,
            f"{key}.train_points={c.train_points} + {key}.val_points={c.val_points} points of {key}.dims={c.dims} "
            f"are {numbers:.3g} numbers, generated in memory: expected at most 2**31 - 1 of them",
        )
