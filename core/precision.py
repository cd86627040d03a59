"""Mixed precision: torch.autocast for bf16, TransformerEngine's autocast for FP8."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch

from core.config import ConfigError, FP8Config, PrecisionConfig
from core.layers import te_autocast

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype(name: Optional[str], key: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def fp8_recipe(cfg: FP8Config):
    """Build TE's FP8 recipe object (Hopper: delayed or current scaling, or 1x128 blocks)."""
    from transformer_engine.common import recipe as te_recipe

    formats = {"hybrid": te_recipe.Format.HYBRID, "e4m3": te_recipe.Format.E4M3}
    if cfg.fp8_format not in formats:
        raise ConfigError(f"precision.fp8.fp8_format={cfg.fp8_format!r}: expected hybrid or e4m3")
    fmt = formats[cfg.fp8_format]
    if cfg.recipe == "delayed":
        return te_recipe.DelayedScaling(fp8_format=fmt, amax_history_len=cfg.amax_history_len,
                                        amax_compute_algo=cfg.amax_compute_algo, margin=cfg.margin)
    if cfg.recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if cfg.recipe == "block":
        return te_recipe.Float8BlockScaling()
    if cfg.recipe == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    raise ConfigError(f"precision.fp8.recipe={cfg.recipe!r}: expected delayed, current, block or mxfp8")


def autocast_factory(cfg: PrecisionConfig, device: torch.device, layer_backend: str,
                     amax_group=None) -> Callable[[], ContextManager]:
    """Return a function that opens the forward pass's precision context."""
    compute = dtype(cfg.autocast_dtype, "precision.autocast_dtype")
    dtype(cfg.param_dtype, "precision.param_dtype")
    if cfg.fp8.enabled and layer_backend != "te":
        raise ConfigError("precision.fp8.enabled needs TransformerEngine layers (model.backend=te on a CUDA GPU)")
    recipe = fp8_recipe(cfg.fp8) if cfg.fp8.enabled else None

    def context() -> ContextManager:
        stack = contextlib.ExitStack()
        if compute is not None and compute != torch.float32:
            stack.enter_context(torch.autocast(device.type, dtype=compute))
        if recipe is not None:
            stack.enter_context(te_autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group))
        return stack

    return context
