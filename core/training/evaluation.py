"""Validation: the recipe's metrics over the whole (or limited) validation set, reduced over ranks.

Two kinds of figures: sums (forward's per-row values, e.g. the loss), all-reduced and turned into means; and, for
recipes whose forward also returns "items" (one entry per item: a sequence, a labelled residue), figures over every
item of the validation set (Spearman, AUROC, ...): the items are kept on the CPU, gathered over the data-parallel
group and summarised by the recipe (`Recipe.summarize_items`). A recipe that returns no items costs nothing more.
"""

from __future__ import annotations

import logging
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from core.layers.context_parallel import ContextParallel
from core.training.device_batches import device_mover


@torch.no_grad()
def evaluate(
    recipe,
    model: nn.Module,
    loader,
    autocast: Callable[[], ContextManager],
    device: torch.device,
    dp_group,
    cp: ContextParallel = ContextParallel(),
) -> dict[str, float]:
    """Metric sums over every valid sample (padding samples count for nothing), reduced over the
    data-parallel group (and the context-parallel one: its ranks hold shares of the same samples), turned into the
    recipe's reported metrics; with the recipe's figures over every valid item when its forward returns "items"."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    item_parts: list[dict[str, torch.Tensor]] = []
    move = device_mover(recipe, cp)
    for batch in loader:
        valid_rows = batch.pop("valid")
        valid = valid_rows.to(device, torch.float64)
        batch = move(batch, device)
        with autocast():
            out = recipe.forward(model, batch, training=False)
        items = out.pop("items", None)
        if items is not None:
            item_parts.append(valid_items(items, valid_rows))
        for key, value in out.items():
            sums[key] = sums.get(key, 0) + (value.to(torch.float64) * valid).sum()
    model.train()
    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    dist.all_reduce(totals, group=dp_group)
    if cp.size > 1:
        dist.all_reduce(totals, group=cp.group)
    totals = dict(zip(keys, totals.tolist()))
    count = totals.pop("count")
    metrics = recipe.summarize_validation({k: v / count for k, v in totals.items()})
    if item_parts:  # the same on every rank: every rank runs the same batches
        figures = summarize_items(recipe, gather_items(item_parts, device, dp_group))
        both = sorted(metrics.keys() & figures.keys())
        if both:
            raise RuntimeError(f"the {recipe.name} recipe reports {both} from both summarize_validation and items")
        metrics.update(figures)
    return metrics


def valid_items(items: dict[str, torch.Tensor], valid_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward's items of one micro-batch ({"row": [N], name: [N, ...]}: row = each item's row in the micro-batch)
    without the items of padding rows, on the CPU, without "row"."""
    row = items["row"].cpu()
    keep = valid_rows.cpu().bool()[row]
    kept = {}
    for key, value in items.items():
        if len(value) != len(row):
            raise RuntimeError(f"forward's items: {key!r} has {len(value)} entries for {len(row)} rows")
        if key != "row":
            kept[key] = value.detach().cpu()[keep]
    return kept


def gather_items(parts: list[dict[str, torch.Tensor]], device: torch.device, group) -> dict[str, torch.Tensor]:
    """Every rank's items of the group, each rank's in its batch order, ranks in order, on every rank (CPU).
    Ranks hold different counts: their sizes are gathered first, then each item tensor padded to the largest."""
    local = {key: torch.cat([part[key] for part in parts]) for key in sorted(parts[0])}
    if not local or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    world = dist.get_world_size(group)
    count = len(next(iter(local.values())))
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([count], dtype=torch.int64, device=device), group=group)
    counts = [int(size) for size in sizes]
    most = max(counts)
    if most == 0:
        return local
    gathered = {}
    for key, value in local.items():
        sent = value.to(torch.uint8) if value.dtype == torch.bool else value  # bool: not a dtype every backend sends
        padded = sent.new_zeros((most, *sent.shape[1:]))
        padded[:count] = sent
        padded = padded.to(device)
        received = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(received, padded, group=group)
        whole = torch.cat([part[:n].cpu() for part, n in zip(received, counts)])
        gathered[key] = whole.bool() if value.dtype == torch.bool else whole
    return gathered


def summarize_items(recipe, items: dict[str, torch.Tensor]) -> dict[str, float]:
    """The recipe's figures over all items, computed on every rank from the same items (so every rank reports the
    same numbers); only the first rank logs the warnings (e.g. a figure the data leaves undefined)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        return recipe.summarize_items(items)
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return recipe.summarize_items(items)
    finally:
        logging.disable(previous)
