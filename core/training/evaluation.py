"""Validation: the recipe's metrics over the whole (or limited) validation set, reduced over ranks."""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def evaluate(
    recipe, model: nn.Module, loader, autocast: Callable[[], ContextManager], device: torch.device, dp_group
) -> dict[str, float]:
    """Metric sums over every valid sample (padding samples count for nothing), reduced over the
    data-parallel group, turned into the recipe's reported metrics."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        valid = batch.pop("valid").to(device, torch.float64)
        batch = recipe.to_device(batch, device)
        with autocast():
            out = recipe.forward(model, batch, training=False)
        for key, value in out.items():
            sums[key] = sums.get(key, 0) + (value.to(torch.float64) * valid).sum()
    model.train()
    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    dist.all_reduce(totals, group=dp_group)
    totals = dict(zip(keys, totals.tolist()))
    count = totals.pop("count")
    return recipe.summarize_validation({k: v / count for k, v in totals.items()})
