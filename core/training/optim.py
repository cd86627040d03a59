"""AdamW with weight-decay parameter groups, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from core.config.schema import OptimConfig, ScheduleName, SchedulerConfig


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float,
                 no_decay_names: set[str]) -> list[dict]:
    """Two groups: decay for weight matrices; none for biases, norm weights (anything under 2-d) and
    the recipe's named exceptions (e.g. position embeddings)."""
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name in no_decay_names else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (optim.name's one choice) over the parameter groups."""
    fused = cfg.fused
    if fused is None:  # one fused kernel for all tensors on GPUs; torch's default (foreach) elsewhere
        fused = all(p.device.type == "cuda" for g in groups for p in g["params"]) or None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)


def lr_multiplier(step: int, total_steps: int, cfg: SchedulerConfig) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine / linear decay to min_lr_ratio at total_steps.
    `step` counts optimizer steps already taken (0 for the first)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == ScheduleName.constant:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.name == ScheduleName.cosine:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))


def apply_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig, schedule_steps: int) -> None:
    """After a resume: every optimizer setting (AdamW's switches such as amsgrad or maximize as well) and the
    schedule's base rate are the config's (a checkpoint restores those it was saved with, and a file may
    hold anything); the schedule's position is `schedule_steps` (the optimizer steps taken, not skipped, from
    the checked training counters), and the learning rate is the schedule's value there (the schedule itself,
    e.g. its length, always comes from the config)."""
    scheduler.base_lrs = []
    scheduler.last_epoch, scheduler._step_count = schedule_steps, schedule_steps + 1
    built_with = {k: v for k, v in getattr(optimizer, "defaults", {}).items() if k not in ("lr", "weight_decay")}
    for group, multiplier in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(built_with)
        group.update(initial_lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                     weight_decay=cfg.weight_decay if group.get("name") != "no_decay" else 0.0)
        group["lr"] = cfg.lr * multiplier(scheduler.last_epoch)
        scheduler.base_lrs.append(cfg.lr)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
