"""Mixed precision: torch.autocast for bf16, TransformerEngine's autocast for FP8."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

from core.config.schema import DType, FP8Config, FP8Format, FP8RecipeName
from core.layers.namespace import te_autocast

DTYPES = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}


def dtype(name: Optional[DType]) -> Optional[torch.dtype]:
    return None if name is None else DTYPES[name]


def fp8_recipe(cfg: FP8Config):
    """TE's FP8 recipe object (Hopper: delayed or current scaling, or 1x128 blocks; Blackwell: MXFP8)."""
    from transformer_engine.common import recipe as te_recipe

    fmt = {FP8Format.hybrid: te_recipe.Format.HYBRID, FP8Format.e4m3: te_recipe.Format.E4M3}[cfg.fp8_format]
    if cfg.recipe == FP8RecipeName.delayed:
        return te_recipe.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=cfg.amax_history_len,
            amax_compute_algo=str(cfg.amax_compute_algo),
            margin=cfg.margin,
        )
    if cfg.recipe == FP8RecipeName.current:
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if cfg.recipe == FP8RecipeName.block:
        return te_recipe.Float8BlockScaling()
    return te_recipe.MXFP8BlockScaling()


def autocast_factory(
    device: torch.device, compute_dtype: Optional[torch.dtype], fp8: Any = None, amax_group=None
) -> Callable[[], ContextManager]:
    """A function that opens the forward pass's precision context: autocast to `compute_dtype` (none for
    fp32 or None), and TE's FP8 autocast with the recipe `fp8`, whose scales agree over `amax_group`."""

    def context() -> ContextManager:
        stack = contextlib.ExitStack()
        if compute_dtype is not None and compute_dtype != torch.float32:
            stack.enter_context(torch.autocast(device.type, dtype=compute_dtype))
        if fp8 is not None:
            stack.enter_context(te_autocast(enabled=True, recipe=fp8, amax_reduction_group=amax_group))
        return stack

    return context
