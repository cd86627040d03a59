"""finetune.mode applied to the model a recipe built, before core.parallel wraps it (core/session.py:build_model):

  full    every weight trains (pretraining, full fine-tuning): the model is left as it is
  frozen  only the modules under finetune.head train; nothing else needs a gradient, so autograd builds no backward
          through the backbone
  lora    LoRA adapters (core/layers/lora.py) on finetune.lora.target_modules; they and the head train. Every other
          weight is frozen and stored in the forward's compute dtype (precision.autocast_dtype: bf16 on GPUs), which
          halves its memory and spares the per-step cast; core/parallel/parallelize.py keeps it there.

finetune.frozen: module prefixes kept frozen in every mode, over the head and LoRA (e.g. [embedding]: frozen
embeddings in a full fine-tuning); adapters LoRA puts under them stay frozen too (where the adapters go depends on
finetune.head and finetune.lora alone, so a checkpoint's model is built the same way without this list).

Frozen weights have requires_grad=False: the optimizer never sees them (core/training/optim.py), DDP and FSDP2 skip
their gradients, Megatron-FSDP makes neither gradient buffers nor fp32 main weights for them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from core.config.errors import ConfigError
from core.config.schema import FinetuneConfig, FinetuneMode
from core.layers.lora import LORA_A, LORA_B, add_lora


def in_head(name: str, head: list[str]) -> bool:
    """Whether the parameter or module `name` lies under one of the finetune.head prefixes."""
    return any(name == p.rstrip(".") or name.startswith(p.rstrip(".") + ".") for p in head)


def is_lora(name: str) -> bool:
    return f".{LORA_A}." in f".{name}" or f".{LORA_B}." in f".{name}"


def apply(
    model: nn.Module, cfg: FinetuneConfig, seed: int, compute_dtype: Optional[torch.dtype], tp_size: int = 1
) -> Optional[str]:
    """Make `model` train what finetune.mode says, less finetune.frozen (in place). Returns the line to log
    (trainable parameters of the total), None for mode=full without frozen modules. ConfigError for a head or frozen
    prefix that names no parameter, LoRA targets that name no module, LoRA with tensor parallelism."""
    names = [name for name, _ in model.named_parameters()]
    frozen = list(cfg.frozen)
    for prefix in frozen:
        _require_parameters(names, "finetune.frozen", [prefix], cfg.mode)
    if cfg.mode == FinetuneMode.full:
        return _freeze(model, frozen) if frozen else None
    head = list(cfg.head)
    if head:
        _require_parameters(names, "finetune.head", head, cfg.mode)
    adapted: list[str] = []
    if cfg.mode == FinetuneMode.lora:
        if tp_size > 1:
            raise ConfigError(
                f"finetune.mode=lora with distributed.tp={tp_size}: the adapters are not split over tensor-parallel "
                "ranks; use distributed.tp=1"
            )
        lora = cfg.lora
        adapted = add_lora(model, list(lora.target_modules), lora.rank, lora.alpha, lora.dropout, seed, tuple(head))
    stored = None
    for name, p in model.named_parameters():
        p.requires_grad_((in_head(name, head) or is_lora(name)) and not in_head(name, frozen))
        if not p.requires_grad and cfg.mode == FinetuneMode.lora and compute_dtype is not None:
            if p.is_floating_point() and p.dtype != compute_dtype:
                p.data = p.data.to(compute_dtype)
                stored = compute_dtype
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    what = (
        f"LoRA rank {cfg.lora.rank} on {len(adapted)} modules ({', '.join(cfg.lora.target_modules)}) and "
        if (adapted)
        else ""
    )
    return (
        f"finetune.mode={cfg.mode}: {trainable / 1e6:.3f}M of {total / 1e6:.3f}M parameters train "
        f"({100 * trainable / max(total, 1):.2f}%: {what}{f'the head {head}' if head else 'no head'})"
        + (f"; kept frozen: {', '.join(frozen)}" if frozen else "")
        + (f"; the frozen weights are stored in {str(stored).removeprefix('torch.')}" if stored else "")
    )


def _require_parameters(names: list[str], key: str, prefixes: list[str], mode: str) -> None:
    """ConfigError naming `key` where no parameter lies under `prefixes`, with the model's top-level modules."""
    if not any(in_head(n, prefixes) for n in names):
        tops = sorted({n.split(".", 1)[0] for n in names})
        raise ConfigError(
            f"{key}={prefixes}: no parameter of the model lies under these prefixes (finetune.mode={mode}); the "
            f"model's top-level modules: {', '.join(tops)}"
        )


def _freeze(model: nn.Module, frozen: list[str]) -> str:
    """finetune.mode=full with finetune.frozen: every weight trains but those under the prefixes."""
    for name, p in model.named_parameters():
        if in_head(name, frozen):
            p.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"finetune.mode=full: {trainable / 1e6:.3f}M of {total / 1e6:.3f}M parameters train "
        f"({100 * trainable / max(total, 1):.2f}%); kept frozen: {', '.join(frozen)}"
    )
