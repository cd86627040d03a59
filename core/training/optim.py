"""AdamW with weight-decay parameter groups (crossed with the fine-tuning learning-rate parts: head, backbone, layer
decay), and the warmup + decay learning-rate schedule (also when a resumed run
is extended)."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from core.config.schema import FinetuneConfig, OptimConfig, ScheduleExtension, ScheduleName, SchedulerConfig
from core.training.state import TrainState


def param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    no_decay_names: set[str],
    lr: float = 1.0,
    finetune: Optional[FinetuneConfig] = None,
    blocks: Sequence[str] = (),
) -> list[dict]:
    """Two groups: decay for weight matrices; none for biases, norm weights (anything under 2-d) and
    the recipe's named exceptions (e.g. position embeddings). Frozen parameters are left out.

    With finetune.backbone_lr_scale or finetune.layer_decay other than 1, those two are crossed with the learning-rate
    parts: the head (finetune.head, at `lr`) and the backbone at lr * backbone_lr_scale, with layer decay one part
    per block of `blocks` (the transformer blocks' module names, in order: block i of L at * layer_decay ** (L - i)),
    one for the parameters before the first block (** (L + 1)) and one for those after the last (** 0). Each such
    group holds its `lr` and `lr_scale` (its share of optim.lr, which the schedule and a resume keep)."""
    params = [(name, p) for name, p in named_params if p.requires_grad]
    scaled = finetune is not None and (finetune.backbone_lr_scale != 1.0 or finetune.layer_decay != 1.0)
    groups: dict[tuple[str, bool], dict] = {}
    seen_block = False
    for name, p in params:
        decays = not (p.dim() < 2 or name in no_decay_names)
        part, scale = "", 1.0
        if scaled:
            part, scale, seen_block = _lr_part(name, finetune, blocks, seen_block)
        group = groups.setdefault((part, decays), _group(part, decays, weight_decay, lr, scale, scaled))
        group["params"].append(p)
    order = sorted(groups, key=lambda k: (k[0] != "head", _part_order(k[0], blocks), not k[1]))
    return [groups[k] for k in order]


def _group(part: str, decays: bool, weight_decay: float, lr: float, scale: float, scaled: bool) -> dict:
    name = ("decay" if decays else "no_decay") if not part else f"{part}.{'decay' if decays else 'no_decay'}"
    group = {"params": [], "weight_decay": weight_decay if decays else 0.0, "name": name}
    if scaled:
        group.update(lr=lr * scale, lr_scale=scale)
    return group


def _lr_part(name: str, cfg: FinetuneConfig, blocks: Sequence[str], seen_block: bool) -> tuple[str, float, bool]:
    """(the learning-rate part of parameter `name`, its share of optim.lr, whether a block has been seen: parameters
    come in the model's order, so those before the first block are the embeddings)."""
    if any(name == h.rstrip(".") or name.startswith(h.rstrip(".") + ".") for h in cfg.head):
        return "head", 1.0, seen_block
    if cfg.layer_decay == 1.0 or not blocks:
        return "backbone", cfg.backbone_lr_scale, seen_block
    depth = len(blocks)
    for i, block in enumerate(blocks):
        if name.startswith(block + "."):
            return f"block{i}", cfg.backbone_lr_scale * cfg.layer_decay ** (depth - i), True
    if not seen_block:
        return "embeddings", cfg.backbone_lr_scale * cfg.layer_decay ** (depth + 1), False
    return "backbone", cfg.backbone_lr_scale, True


def _part_order(part: str, blocks: Sequence[str]) -> int:
    if part == "embeddings":
        return -1
    if part.startswith("block") and part[5:].isdigit():
        return int(part[5:])
    return len(blocks)


# The settings that decide the parameter groups (their number, their members, whether each carries its own lr): a
# resume that changes them cannot take the saved optimizer state.
GROUP_KEYS = ("finetune.mode", "finetune.head", "finetune.backbone_lr_scale", "finetune.layer_decay")


def groups_mismatch(saved: dict[int, set[str]], groups: list[dict]) -> Optional[str]:
    """Why an optimizer state whose groups held the settings `saved` ({group index: its keys}) cannot be loaded into
    an optimizer of `groups`; None when it can. The groups are matched by position, and a group with its own learning
    rate share (lr_scale) in one and not in the other does not fit either."""
    names = ", ".join(str(g.get("name", i)) for i, g in enumerate(groups))
    if len(saved) != len(groups):
        return f"its optimizer state has {len(saved)} parameter groups, this run's optimizer {len(groups)} ({names})"
    for i, group in enumerate(groups):
        if ("lr_scale" in saved.get(i, set())) != ("lr_scale" in group):
            where = ("this run", "the checkpoint") if "lr_scale" in group else ("the checkpoint", "this run")
            return (
                f"parameter group {i} ({group.get('name', i)}) has a learning-rate share of its own (lr_scale) in "
                f"{where[0]}, not in {where[1]}"
            )
    return None


def build_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (optim.name's one choice) over the parameter groups."""
    fused = cfg.fused
    if fused is None:  # one fused kernel for all tensors on GPUs; torch's default (foreach) elsewhere
        fused = all(p.device.type == "cuda" for g in groups for p in g["params"]) or None
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
    # Each group's share of optim.lr as the config gives it (loading a checkpoint replaces the groups' own
    # settings with the saved ones; apply_config restores the config's).
    optimizer.lr_scales = [g.get("lr_scale", 1.0) for g in groups]
    return optimizer


def lr_multiplier(step: int, total_steps: int, cfg: SchedulerConfig) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine / linear decay to min_lr_ratio at total_steps; constant;
    or wsd: constant until its decay, then linear to min_lr_ratio at total_steps. Past total_steps: the final value.
    `step` counts optimizer steps already taken (0 for the first)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == ScheduleName.constant:
        return 1.0
    start = decay_start(total_steps, cfg)
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    if cfg.name == ScheduleName.cosine:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear, wsd
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def decay_start(total_steps: int, cfg: SchedulerConfig) -> int:
    """The optimizer step (counted from 0) at which the decay of a schedule over `total_steps` begins: after the warmup,
    or for wsd its last decay_steps (decay_fraction of total_steps); total_steps for constant (never)."""
    if cfg.name == ScheduleName.constant:
        return total_steps
    if cfg.name != ScheduleName.wsd:
        return cfg.warmup_steps
    decay = cfg.decay_steps if cfg.decay_steps is not None else round(cfg.decay_fraction * total_steps)
    return max(cfg.warmup_steps, total_steps - decay)


def schedule_notes(cfg: SchedulerConfig, lr: float, total_steps: int) -> list[str]:
    """What a schedule over `total_steps` does other than its settings say, one line each, for a warning before the
    first step: a warmup as long as the run or longer (the rate never reaches optim.lr, or reaches it only at the
    last step, and never decays), a wsd decay longer than the steps left after the warmup (it starts later and is
    steeper than asked). Not refused: a short test run (training.steps=2) of a config with a warmup is common."""
    notes = []
    if 0 < total_steps <= cfg.warmup_steps:
        peak = lr_multiplier(total_steps - 1, total_steps, cfg) * lr
        decays = "" if cfg.name == ScheduleName.constant else " and never decays"
        notes.append(
            f"scheduler.warmup_steps={cfg.warmup_steps} spans the whole run of {total_steps} steps: the learning "
            f"rate rises to {peak:.3g} at most (optim.lr={lr:g}){decays} (set scheduler.warmup_steps below the "
            "run's steps)"
        )
        return notes
    if cfg.name != ScheduleName.wsd:
        return notes
    asked = cfg.decay_steps if cfg.decay_steps is not None else round(cfg.decay_fraction * total_steps)
    spans = total_steps - decay_start(total_steps, cfg)
    if spans < asked:
        given = (
            f"scheduler.decay_steps={cfg.decay_steps}"
            if cfg.decay_steps is not None
            else f"scheduler.decay_fraction={cfg.decay_fraction:g} ({asked} steps)"
        )
        notes.append(
            f"{given} does not fit in the run's {total_steps} steps after scheduler.warmup_steps={cfg.warmup_steps}: "
            f"the decay spans only the last {spans} steps"
        )
    return notes


def _multiplier(cfg: SchedulerConfig, total_steps: int) -> Callable[[int], float]:
    # A function, not an object: LambdaLR saves an object's attributes into the checkpoint.
    return lambda step: lr_multiplier(step, total_steps, cfg)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _multiplier(cfg, total_steps))


def resume_schedule(
    optimizer: torch.optim.Optimizer,
    scheduler,
    optim_cfg: OptimConfig,
    cfg: SchedulerConfig,
    state: TrainState,
    run_steps: int,
) -> list[str]:
    """After a resume (the checkpoint's scheduler state and counters loaded): the schedule spans `run_steps`
    (scheduler.on_extend=stretch) or keeps the length the run started with (hold: state.schedule_steps, recorded in
    the checkpoint), and the learning rate and optimizer settings in effect are the config's (apply_config). Returns
    what to warn about, one line each: a learning rate at the resumed step other than the one the checkpoint's run
    would have used (an extension that changes the rate's path), a held schedule that has ended."""
    saved_lr = scheduler.get_last_lr()[0]  # the checkpoint's: the rate its run would have used next
    recorded, hold, notes = state.schedule_steps, cfg.on_extend == ScheduleExtension.hold, []
    length = recorded if hold and recorded else run_steps
    if hold and not recorded:
        notes.append(
            f"scheduler.on_extend=hold: the checkpoint does not record the length of its schedule (an earlier "
            f"version wrote it): the schedule spans training.steps={run_steps}"
        )
    state.schedule_steps = length
    scheduler.lr_lambdas = [_multiplier(cfg, length) for _ in scheduler.lr_lambdas]
    position = state.step - state.skipped_steps
    apply_config(optimizer, scheduler, optim_cfg, position)
    lr = scheduler.get_last_lr()[0]
    if not math.isclose(lr, saved_lr, rel_tol=1e-6, abs_tol=1e-12):
        notes.append(
            f"the learning rate at step {state.step + 1} is {lr:.3g}, not the {saved_lr:.3g} the checkpoint's "
            f"run would have used: {_why_changed(cfg, recorded, length, position)}"
        )
    if hold and position >= length and run_steps > state.step:
        idle = ": they change nothing (weight decay too is scaled by the rate)" if lr == 0 else ""
        notes.append(
            f"scheduler.on_extend=hold: the schedule ended at step {length}; steps {state.step + 1}-{run_steps} "
            f"keep its final learning rate {lr:.3g} (scheduler.min_lr_ratio={cfg.min_lr_ratio} x optim.lr){idle}"
        )
    return notes


def _why_changed(cfg: SchedulerConfig, recorded: int, length: int, position: int) -> str:
    """Why a resumed schedule's learning rate differs from the checkpoint's, and what keeps it, in words."""
    if not recorded:
        return (
            f"the schedule spans training.steps={length} (the checkpoint does not record the length its schedule "
            "started with), or its settings changed"
        )
    if recorded == length:
        return "the schedule's settings differ from the checkpoint's"
    began = (
        f", and its decay had begun (at step {decay_start(recorded, cfg) + 1}): the rate is back at the stable rate, "
        f"and decays again from step {decay_start(length, cfg) + 1}"
        if cfg.name == ScheduleName.wsd and position >= decay_start(recorded, cfg)
        else ""
    )
    return (
        f"the {cfg.name} schedule now spans training.steps={length}, not the {recorded} it started with{began}. "
        "scheduler.on_extend=hold keeps the schedule it started with (steps past its end at its final rate); a "
        "scheduler=wsd run extended before its decay begins goes on at the same rate"
    )


def apply_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig, schedule_steps: int) -> None:
    """After a resume: every optimizer setting (AdamW's switches such as amsgrad or maximize as well) and the
    schedule's base rate are the config's (a checkpoint restores those it was saved with, and a file may
    hold anything); the schedule's position is `schedule_steps` (the optimizer steps taken, not skipped, from
    the checked training counters), and the learning rate is the schedule's value there (the schedule itself comes from
    the config; its length from resume_schedule)."""
    scheduler.base_lrs = []
    scheduler.last_epoch, scheduler._step_count = schedule_steps, schedule_steps + 1
    built_with = {k: v for k, v in getattr(optimizer, "defaults", {}).items() if k not in ("lr", "weight_decay")}
    scales = getattr(optimizer, "lr_scales", [1.0] * len(optimizer.param_groups))
    for group, multiplier, scale in zip(optimizer.param_groups, scheduler.lr_lambdas, scales):
        group.update(built_with)
        group.update(
            initial_lr=cfg.lr * scale,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay if not str(group.get("name", "")).endswith("no_decay") else 0.0,
        )
        if "lr_scale" in group:
            group["lr_scale"] = scale
        group["lr"] = cfg.lr * scale * multiplier(scheduler.last_epoch)
        scheduler.base_lrs.append(cfg.lr * scale)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
