"""A batch from the loader to what this rank computes on: the recipe's to_device, then, with context parallelism
(distributed.cp > 1), the recipe's share of every sequence for this rank (training and validation alike)."""

from __future__ import annotations

from typing import Callable

import torch

from core.layers.context_parallel import ContextParallel


def device_mover(recipe, cp: ContextParallel) -> Callable[[dict, torch.device], dict]:
    """(batch, device) -> this rank's batch on the device."""
    if cp.size == 1:
        return recipe.to_device

    def move(batch: dict, device: torch.device) -> dict:
        return recipe.context_parallel_share(recipe.to_device(batch, device), cp)

    return move
